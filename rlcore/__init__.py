"""rlcore: fully asynchronous RL for LLMs. Pure objectives, a thin stateful runtime."""

__version__ = "0.1.0"
