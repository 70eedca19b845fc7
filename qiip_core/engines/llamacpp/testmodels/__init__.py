"""Models to test against, not to serve: small random-weight GGUFs written for every architecture family the
planner models (`_generate`, with one module of writers per family: `_llama`, `_gemma`, `_moe`, `_recurrent`,
`_embed`), and the real published Gemma 3 270M assembled from its packages (`_published`).

`qiip_core.engines.llamacpp` exports the names (`make_test_gguf`, `TEST_ARCHITECTURES`, `fetch_test_model`,
`GEMMA3_270M`, `PublishedModel`); this package itself exports nothing.
"""

from __future__ import annotations

__all__: list[str] = []
