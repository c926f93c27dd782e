"""rollout.server: the HTTP layer. SGLang's native endpoints and the OpenAI API over one in-process
Engine (FastAPI + uvicorn, the `server` extra). Start it with `python -m rollout.launch_server`."""

from rollout.server.app import create_app
from rollout.server.args import ServerArgs, parse_args

__all__ = ["ServerArgs", "create_app", "parse_args"]
