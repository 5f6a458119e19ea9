"""The plumbing that the web and the worker share beside the Celery message: the reply channel (replies.py), and the
engines' busy flags that a CPU trainer on the same host reads to hold its work while inference runs (busy.py).

Every side imports it, so it sits below them all: it imports no app of the project (pyproject's import-linter
contract), only Django's settings to pick Redis or files and the var directory. What travels on it is typed in
protocol/.
"""
