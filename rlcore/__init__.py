"""rlcore: fully asynchronous RL for LLMs. Pure objectives, a thin stateful runtime."""

__version__ = "0.2.0"
