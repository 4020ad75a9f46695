from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.harness import ServerProcess, start_server


@pytest.fixture(scope="package")
def smollm_server() -> Iterator[ServerProcess]:
    """SmolLM2-135M-Instruct from its GGUF, float32, default scheduler settings."""
    server = start_server("--dtype", "float32", "--metrics-port", "0")
    yield server
    code = server.stop()
    assert code == 0, server.log()[-4000:]
    assert server.leftovers() == [], f"processes left behind: {server.leftovers()}"
