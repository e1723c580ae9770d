"""lm-evaluation-harness's loglikelihood scoring through ``/v1/completions`` equals its ``hf``.

lm-eval's ``local-completions`` scores each multiple-choice continuation with one
``echo: true`` + ``logprobs`` request of the context and continuation token ids (0.4.13 sends
``max_tokens: 1`` and drops the last entry; ``max_tokens: 0`` is covered by
``test_prompt_logprobs_api.py``). Here it runs against a live gateway serving the tiny text
model, its ``hf`` backend runs on the same checkpoint, and both must give the same accuracy and
per-choice loglikelihoods (float32). The task is a local JSON file (no dataset download).

Needs the optional ``lm_eval[api]`` (``pip install "lm_eval[api]" torch==<the installed one>``);
skipped without it.
"""

import json

import pytest

pytestmark = pytest.mark.slow

DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "A cat says", "choices": [" meow", " woof", " moo", " quack"], "answer": 0},
    {"question": "Water is", "choices": [" wet", " dry"], "answer": 0},
    {"question": "The sun rises in the", "choices": [" east", " west"], "answer": 0},
]
TASK = """task: loraplex_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
"""


def _loglikelihoods(result):
    return [[r[0] for r in s["filtered_resps"]] for s in result["samples"]["loraplex_tiny_mc"]]


def test_local_completions_scores_what_hf_scores(text_dir, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm_eval[api]
    from lm_eval.tasks import TaskManager

    from loraplex.engine.config import EngineConfig
    from loraplex.gateway.server.build import start_engine
    from tests.gateway.live import LiveGateway

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(TASK.format(data=data))
    tasks = TaskManager(include_path=str(tmp_path / "tasks"))
    engine = start_engine(
        EngineConfig(model=str(text_dir), served_model_name="tiny-text"), tmp_path / "store"
    )
    try:
        with LiveGateway(engine, tmp_path / "gateway") as live:
            monkeypatch.setenv("OPENAI_API_KEY", live.create_tenant("eval")["api_key"])
            served = lm_eval.simple_evaluate(
                model="local-completions",
                model_args=(
                    f"model=tiny-text,base_url={live.base_url}/v1/completions,"
                    f"tokenizer={text_dir},tokenized_requests=True,num_concurrent=1,max_retries=1"
                ),
                tasks=["loraplex_tiny_mc"],
                task_manager=tasks,
                log_samples=True,
            )
    finally:
        engine.shutdown()
    hf = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={text_dir},dtype=float32,device=cpu",
        tasks=["loraplex_tiny_mc"],
        task_manager=tasks,
        log_samples=True,
    )
    acc = served["results"]["loraplex_tiny_mc"]["acc,none"]
    assert acc == hf["results"]["loraplex_tiny_mc"]["acc,none"]
    ours, theirs = _loglikelihoods(served), _loglikelihoods(hf)
    assert [len(x) for x in ours] == [len(d["choices"]) for d in DOCS]
    for mine, want in zip(ours, theirs, strict=True):
        assert mine == pytest.approx(want, abs=1e-4)
