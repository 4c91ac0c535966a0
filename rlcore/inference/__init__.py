"""Inference wing: engine, sampling, SGLang-protocol server, client, SGLang launcher. Imports no rollout/training."""
