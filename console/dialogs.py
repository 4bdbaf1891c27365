"""Modal screens: the confirmation every change to the box goes through, and `?` help."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Static

HELP = """\
[b]appliance console[/b]: keys (also in the footer)

  d dashboard   t templates   r requests   l audit   ? this help   q quit
  templates   ↑/↓ choose · a apply (asks first) · b roll back to the
              template that ran before the last apply · k change a live
              knob (scheduler.max_num_seqs = 8; shows the diff, asks first)
  audit       ↑/↓ choose a class · p pause · g drain · u resume (each
              asks first); below, the audit log: who changed what, when
  requests    ↑/↓ choose · x abort the chosen request (asks first);
              columns: tokens of prompt and output so far, KV blocks held,
              age, times preempted
  --readonly hides every key that changes the box.

[b]Dashboard[/b]: refreshed every second from GET /admin/stats unless said
  KV cache     used / cached / free blocks; usage counts cached blocks as
               free (as vLLM does); slot utilisation; the block map (one
               cell per block, downsampled when blocks outnumber cells)
  Batch        running / waiting / swapped now; sequences per engine step
               over the last minute
  Preemptions  totals by mode and by class, count in the last minute, the
               latest ones (request, class, mode); cut-in: prefill steps
               paused between layers for requests that outranked them
  Throughput   prompt and generated tokens/s per second (step history);
               TTFT, TPOT p50/p99 over 30 s of the /metrics histograms
  Why slow     which limit bound each step of the last minute (token
               budget, max_num_seqs, KV blocks; idle: not enough work), and
               each class's oldest waiting request against its timeout
  GPU · host   pynvml on this machine, else "no GPU" and host CPU and
               memory (psutil)
"""


class ConfirmScreen(ModalScreen[bool]):
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical { width: 70; max-width: 95%; height: auto; max-height: 90%;
                               border: thick $warning; background: $surface; padding: 1 2; }
    ConfirmScreen #question { height: auto; }
    ConfirmScreen Horizontal { height: auto; align: center middle; margin-top: 1; }
    ConfirmScreen Button { margin: 0 2; }
    """
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str, yes: str = "Yes") -> None:
        super().__init__()
        self.question, self.yes = question, yes

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.question, id="question")
            with Horizontal():
                yield Button(f"{self.yes} (y)", variant="warning", id="yes")
                yield Button("Cancel (n)", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class InputScreen(ModalScreen[str | None]):
    """One line of text (Enter), or None (Escape)."""

    DEFAULT_CSS = """
    InputScreen { align: center middle; }
    InputScreen > Vertical { width: 70; max-width: 95%; height: auto; border: thick $accent;
                             background: $surface; padding: 1 2; }
    InputScreen #prompt { height: auto; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, prompt: str, placeholder: str = "") -> None:
        super().__init__()
        self.prompt, self.placeholder = prompt, placeholder

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.prompt, id="prompt")
            yield Input(placeholder=self.placeholder, id="line")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 100; max-width: 100%; height: 100%;
                                  border: round $primary; background: $surface; padding: 0 1; }
    """
    BINDINGS = [Binding("escape,question_mark,q", "close", "Close")]

    def __init__(self, readonly: bool) -> None:
        super().__init__()
        self.readonly = readonly

    def compose(self) -> ComposeResult:
        note = (
            "[b]read-only[/b]: apply, roll back and abort are hidden.\n\n" if self.readonly else ""
        )
        with VerticalScroll():
            yield Static(note + HELP)

    def action_close(self) -> None:
        self.dismiss(None)
