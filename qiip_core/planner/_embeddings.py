"""How llama-server runs a model with `--embeddings`, and what that costs beyond the graph: the micro-batch it
must be launched with, and its output buffer.

Serving embeddings changes three things the planner must get right (read from `tools/server/server.cpp`,
`server-context.cpp` and `src/llama-context.cpp`):

- **The batch is the micro-batch.** With `--embeddings` llama-server lowers `--batch-size` to `--ubatch-size`
  (every input must be encoded in one micro-batch), so one decode returns at most `n_ubatch` outputs, and
  every token of it is an output (`output_all`).
- **Some inputs cannot be split.** An encoder has no memory (`create_memory` returns none for bert-like
  models), so an input is encoded whole: longer than the micro-batch, it is refused (*input is too large to
  process. increase the physical batch size*). Its batch size is not capped by the context either
  (`cparams.n_batch` is the context only for causal attention), so llama-server batches several slots'
  inputs up to `n_batch` tokens, beyond the `min(n_ctx, n_ubatch)` tokens its compute buffer was reserved
  for, and the buffer grows at run time. An encoder is therefore launched with `--batch-size` =
  `--ubatch-size` = `min(training context, --ctx-size)`: the longest input a slot accepts, and exactly the
  micro-batch reserved.
- **Mean pooling needs a micro-batch that divides by the slots.** The reserved micro-batch is rounded up to
  a multiple of the slots (`graph_reserve`) but keeps `min(n_ctx, n_ubatch)` outputs; mean pooling then
  multiplies `outputs` rows by a `[tokens, slots]` matrix, and llama-server aborts at start in
  `ggml_mul_mat` (`build_pooling`). The micro-batch is lowered to a multiple of the slots.

The output buffer (`llama_context::output_reserve`) holds one row per output: the logits (every model, an
encoder without an LM head too) and, with embeddings, the embedding. It is allocated at start for one
output per slot, which is what the log prints (`output buffer size`), and grows with the first batch of
embeddings to one row per token of the batch: that is what the fit rule must count.
"""

from __future__ import annotations

from qiip_core.planner._shape import ModelShape

__all__ = ["FLOAT_BYTES", "embeddings_ubatch", "output_buffer_bytes", "output_rows"]

FLOAT_BYTES = 4
"""The output buffer holds F32 values (`sizeof(float)` in `output_reserve`)."""


def embeddings_ubatch(shape: ModelShape, *, aggregate_context: int, slots: int, n_ubatch: int = 512) -> int:
    """The micro-batch, in tokens, an embeddings server is launched with (`--ubatch-size`, `--batch-size` equal).

    Args:
        shape: the model; an encoder is a model without memory (`memory == "none"`).
        aggregate_context: `--ctx-size` in tokens.
        slots: `--parallel`.
        n_ubatch: the micro-batch asked for (llama-server's default 512); an encoder's is its slot context.

    Returns:
        For an encoder `min(n_ctx_train, aggregate_context)`, else `min(aggregate_context, n_ubatch)`; with
        mean pooling lowered to a multiple of `slots` (at least `slots`).
    """
    if shape.memory == "none":
        tokens = min(shape.n_ctx_train, aggregate_context)
    else:
        tokens = min(aggregate_context, n_ubatch)
    if shape.embeddings_pooling == "mean" and tokens % slots:
        tokens = max(slots, tokens // slots * slots)
    return tokens


def output_rows(*, slots: int, ubatch: int, embeddings: bool) -> int:
    """Rows of the output buffer once it has grown to the largest decode llama-server runs.

    Args:
        slots: `--parallel`; the buffer never has fewer rows (`output_reserve`: `max(n_outputs, n_seq_max)`).
        ubatch: the micro-batch in tokens, which with embeddings is also the batch.
        embeddings: every token is an output; without, one output per slot (`server_output_limits`).
    """
    return max(slots, ubatch) if embeddings else slots


def output_buffer_bytes(shape: ModelShape, *, rows: int, embeddings: bool) -> int:
    """Bytes of llama-server's output buffer with `rows` rows (`llama_context::output_reserve`).

    Each row holds the logits, `n_vocab` floats, even for an encoder that computes none (`has_logits` is
    always set), and with embeddings the embedding, `n_embd` floats.

    Args:
        shape: the model.
        rows: output rows: `slots` at start (what the log prints), `output_rows` at the peak.
        embeddings: `--embeddings`.
    """
    return (shape.n_vocab + (shape.n_embd if embeddings else 0)) * rows * FLOAT_BYTES
