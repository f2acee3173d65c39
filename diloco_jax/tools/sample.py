"""Generate text from an exported model: `python -m diloco_jax sample`.

  python -m diloco_jax sample --model runs/x/model --prompt "def " [--max-tokens 200] [--temperature 0.8]

The prompt starts a document (it follows an eos token, as every document but the first does in training).
Each new token comes from one jitted decode step: the forward pass over a fixed-size window of the
sequence so far (causal attention makes the padding after it irrelevant), then the argmax of the last
logits (`--temperature 0`, the default: greedy) or a draw from softmax(logits / temperature), optionally
among the `--top-k` most likely. No KV cache: each step costs a full forward pass over at most
`model.max_seq_len` tokens (the window slides once the sequence is longer), which keeps it simple and exactly
the model's training-time computation. Generation stops at `--max-tokens` or at an eos token.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax import cli, command_flags
from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.compute import model as model_lib
from diloco_jax.runs import export as export_lib


@functools.lru_cache(maxsize=8)
def decode_step(graphdef, mesh, top_k: int):
  """The jitted step `(params, window [1, L], length, key, temperature) -> next token id`: greedy when
  `temperature` is 0, else a draw at that temperature (among the `top_k` most likely when top_k > 0)."""

  def step(params, window, length, key, temperature):
    logits = model_lib.apply(graphdef, params, window)[0]
    last = jax.lax.dynamic_index_in_dim(logits, length - 1, keepdims=False)
    if top_k > 0:
      kth = jax.lax.top_k(last, top_k)[0][-1]
      last_k = jnp.where(last < kth, -jnp.inf, last)
    else:
      last_k = last
    drawn = jax.random.categorical(key, last_k / jnp.maximum(temperature, 1e-6))
    return jnp.where(temperature > 0, drawn, jnp.argmax(last)).astype(jnp.int32)

  replicated = mesh_lib.replicated(mesh)
  return jax.jit(step, in_shardings=(None, replicated, replicated, replicated, replicated),
                 out_shardings=replicated)


def generate(model: export_lib.Model, prompt_ids, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, stop_at_eos: bool = True) -> np.ndarray:
  """The ids generated after `prompt_ids` (at most `max_new_tokens`; the eos that stops it included)."""
  if max_new_tokens < 1:
    return np.zeros(0, np.int32)
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  ids = [int(i) for i in prompt_ids]
  if not ids:
    raise ValueError("the prompt must hold at least one token")
  width = min(model.config.model.max_seq_len, len(ids) + max_new_tokens)
  step = decode_step(model.graphdef, model.mesh, int(top_k) if temperature > 0 else 0)
  key = jax.random.key(seed)
  window = np.zeros((1, width), np.int32)
  new = []
  for _ in range(max_new_tokens):
    context = ids[-width:]
    window[0, :len(context)] = context
    window[0, len(context):] = 0
    key, draw = jax.random.split(key)
    token = int(step(model.params, window, np.int32(len(context)), draw, np.float32(temperature)))
    ids.append(token)
    new.append(token)
    if stop_at_eos and token == model.tokenizer.eos_id:
      break
  return np.asarray(new, np.int32)


def sample_text(argv) -> int:
  """`python -m diloco_jax sample --model DIR --prompt TEXT`; see the module docstring."""
  fv = cli.parse(argv, command_flags.sample, doc=__doc__, config=False)
  cli.enable_compilation_cache()
  if fv.temperature < 0:
    raise cli.UsageError(f"--temperature must be >= 0, got {fv.temperature}")
  try:
    model = export_lib.load(fv.model, jax.devices()[:fv.devices or None])
  except (FileNotFoundError, ValueError) as e:
    raise cli.UsageError(f"--model: {e}") from None
  tok = model.tokenizer
  prompt = np.concatenate([[tok.eos_id], tok.encode(fv.prompt)]).astype(np.int32)
  new = generate(model, prompt, max_new_tokens=fv["max-tokens"].value, temperature=fv.temperature,
                 top_k=fv["top-k"].value, seed=fv.seed)
  if new.size and new[-1] == tok.eos_id:
    new = new[:-1]
  sys.stdout.write(tok.decode(np.concatenate([prompt[1:], new])) + "\n")
  return 0
