"""The Django-free contract shared by the web, the worker and the planner.

Imports nothing of the project: `lora_layout` (the LoRA target projections and their shapes) and
`memory` (the one arithmetic of the worker's memory pool, read by the worker and by the capacity planner).
"""
