"""Schema-driven fuzzing: schemathesis generates requests, valid and invalid, from the app's OpenAPI spec and
sends them in-process (ASGI); whatever it sends, the server answers without a 5xx and ends with a full KV pool.

The strategies are driven by hand (`operation.as_strategy` under hypothesis' `given`) rather than through
`schemathesis.pytest.from_fixture`, whose lazy fixtures break under pytest 9, and a schema loaded at import
would load the models whenever the test suite is collected."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.serve.test_api import MODEL, Server


@pytest.fixture(scope="module")
def served():
    server = Server(num_blocks=5)  # an 80-token context keeps every answer short (a chat prompt takes ~35)
    server.worker.start()  # in-process calls need not run the app's lifespan
    yield server
    server.worker.shutdown()


def aimed(case):
    """Most generated bodies name a random model; name ours, so the case reaches generation."""
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL
    return case


def test_no_server_errors(served):
    schema = schemathesis.openapi.from_asgi("/openapi.json", served.app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    for operation in operations:
        cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE).map(aimed),
                          operation.as_strategy(GenerationMode.NEGATIVE),
                          operation.as_strategy(GenerationMode.NEGATIVE).map(aimed))

        @given(case=cases)
        @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case):
            case.call_and_validate(checks=[not_a_server_error])

        check()
    engine = served.worker.engine
    assert served.metric("eyas_generation_tokens_total") > 0  # some cases reached the engine
    assert served.metric("eyas_requests_finished_total", reason="error") == 0
    served.wait_idle()
    assert not engine.has_work() and engine.pool.allocator.num_free == served.num_blocks
