"""A real ``loraplex serve`` SIGKILLed during a load and restarted: every response a client
received whole has its usage row, with its tokens (issue 13: 17 of 410 were lost).

The load, the kill and the comparison are ``bench.hostile.usage.sigkill_loss`` (the figure
``usage_rows_lost_sigkill`` of ``python -m bench.hostile.usage``), with one kill.
"""

import pytest

from bench.hostile.usage import sigkill_loss

pytestmark = pytest.mark.slow


def test_no_received_response_loses_its_row_to_a_sigkill(llava_dir, tmp_path):
    figures = sigkill_loss(budget_s=0, min_kills=1, clients=6, data_dir=tmp_path, model=llava_dir)
    assert figures["sigkill_rounds"] == 1
    assert figures["sigkill_responses_received"] > 0, figures
    assert figures["usage_rows_lost_sigkill"] == 0, figures
    assert figures["sigkill_completion_tokens_lost"] == 0, figures
    log = (tmp_path / "data" / "serve.log").read_text()
    assert "Traceback" not in log, log[-4000:]
