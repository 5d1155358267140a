"""The model runtime: loading, the transformer forward over a paged KV cache, sampling."""
from .attention import AttentionMetadata
from .loader import ModelConfig, ModelFiles, default_model_path
from .runner import ModelRunner
from .sampler import SamplingParams, sample
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["AttentionMetadata", "IncrementalDetokenizer", "ModelConfig", "ModelFiles", "ModelRunner",
           "SamplingParams", "Tokenizer", "default_model_path", "sample"]
