from __future__ import annotations

from collections.abc import Iterator

import pytest

from duoserve_client import Client
from tests.e2e.harness import PROMPTS, ServerProcess, chat, start_server


@pytest.fixture(scope="package")
def smollm_server() -> Iterator[ServerProcess]:
    """SmolLM2-135M-Instruct from its GGUF, float32, default scheduler settings."""
    server = start_server("--dtype", "float32", "--metrics-port", "0")
    yield server
    code = server.stop()
    assert code == 0, server.log()[-4000:]
    assert server.leftovers() == [], f"processes left behind: {server.leftovers()}"


@pytest.fixture(scope="package")
def reference(smollm_server: ServerProcess) -> dict[str, tuple[str, list[int]]]:
    """Each prompt's greedy completion, computed alone."""
    with Client(smollm_server.target) as client:
        results = {}
        for prompt in PROMPTS:
            completion = chat(client, prompt)
            results[prompt] = (completion.text, completion.token_ids)
        return results
