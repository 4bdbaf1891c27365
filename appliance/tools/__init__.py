"""Operator tools beside the serving path: the memory planner (`appliance plan`), the length
router (`appliance route`), the KV-quantization evaluation (`appliance kv-eval`) and the
offline demo models. The engine and the server never depend on them to serve a request."""
