"""The plumbing that the web and the worker share beside the Celery message: the reply channel (replies.py).

Both sides import it, so it sits below both: it imports no app of the project (pyproject's import-linter
contract), only Django's settings to pick Redis or files. What travels on it is typed in protocol/.
"""
