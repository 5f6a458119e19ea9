"""The Django-free contract shared by the web, the worker and the planner.

Imports nothing of the project: `lora_layout` (the LoRA target projections and their shapes), `memory`
(the one arithmetic of the worker's memory pool, read by the worker and by the capacity planner),
`safetensors_check` (the hardened reader), `errors` (ErrorCode: a worker error and its HTTP status).
"""
