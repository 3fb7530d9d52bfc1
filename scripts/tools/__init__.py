"""User tools: converting and shipping exports, building and shipping data, offline scoring:
`python -m scripts.tools.<name>`."""
