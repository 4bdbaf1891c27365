"""The appliance as a Ray Serve application: replicas that each own one appliance server and
engine, an ingress that serves the same OpenAI API in front of them, an autoscaling policy on
the engines' own queue figures, and the `appliance cluster` commands (docs/cluster.md).

Ray is an optional extra (`pip install appliance[cluster]`): only the modules that deploy
import it, so the settings and the routing policy load without it."""
