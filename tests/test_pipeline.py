"""torch.distributed.pipelining schedules checked against the full batch on gloo
ranks: which scale_grads / loss settings are equivalent, the upstream mistakes
found, and uneven micro-batch sizes refused by torch's stages."""

import dataclasses

import jsonschema
import pytest

from equiv.checking.pipeline import SCHEDULES, PipelineSetting, check_pipeline
from equiv.distributed.launcher import DistributedCheckError
from equiv.outcomes import Fault, Outcome
from equiv.results.protocol import schema
from equiv.zoo.pipeline_bugs import PIPELINE_ZOO


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(PIPELINE_ZOO))
def test_pipeline_setting_comes_to_what_it_must_under_1f1b(name: str) -> None:
    entry = PIPELINE_ZOO[name]
    verdict = check_pipeline(dataclasses.replace(entry.setting, schedule="1F1B"))
    assert verdict.status is entry.expected, verdict.message()
    # Judged by the engine in the exact tier (the floor plan: float32 and shuffled-batch samples, float64 roundoff):
    # a correct setting sits well inside it, a weighting mistake orders of magnitude past it.
    if verdict.status is Outcome.EQUIVALENT:
        assert verdict.worst_ratio is not None and verdict.worst_ratio <= 1.0
    elif verdict.status is Outcome.NOT_EQUIVALENT:
        assert verdict.worst_ratio is not None and verdict.worst_ratio > 1e6, verdict.message()
        assert "x allowed" in verdict.message() and "unit roundoff" in verdict.message()


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "1F1B"])
def test_every_schedule_is_exact_with_a_window_sum_and_off_with_the_default_on_ragged_items(schedule: str) -> None:
    right = check_pipeline(dataclasses.replace(PIPELINE_ZOO["window_sum_unscaled"].setting, schedule=schedule))
    assert right.status is Outcome.EQUIVALENT, right.message()
    default = check_pipeline(dataclasses.replace(PIPELINE_ZOO["mean_scaled_ragged_items"].setting, schedule=schedule))
    assert default.status is Outcome.NOT_EQUIVALENT, default.message()


@pytest.mark.distributed
def test_uneven_chunks_are_reported_as_not_runnable_with_torchs_error() -> None:
    verdict = check_pipeline(PipelineSetting(schedule="GPipe", scale_grads=False, loss="window_sum", batch_size=7))
    assert verdict.status is Outcome.STEP_ERROR and not verdict
    assert verdict.error and "could not run" in verdict.message()
    assert verdict.fault is Fault.RAISED and "pipeline GPipe" in verdict.error  # the ranks' report, whole
    assert verdict.setting.chunk_sizes == (2, 2, 2, 1)


@pytest.mark.parametrize("fault", list(Fault))
def test_ranks_that_give_no_verdict_fail_as_check_distributeds_do(fault: Fault) -> None:
    # The launcher's report and its Fault are kept as data, the report not searched for an error line.
    report = "mismatched collectives: rank 0 called all_reduce\n  rank 1 called broadcast; pipeline GPipe"

    def launcher(task: object, world_size: int, **options: object) -> list[object]:
        raise DistributedCheckError(report, fault)

    setting = PipelineSetting(schedule="GPipe", scale_grads=False, loss="window_sum")
    verdict = check_pipeline(setting, launcher=launcher)  # type: ignore[arg-type]
    assert verdict.status is Outcome.STEP_ERROR and not verdict
    assert verdict.fault is fault and verdict.error == report
    assert verdict.message().endswith(f"could not run on these ranks: {report}")
    out = verdict.to_dict()
    assert out["fault"] == fault.value and "\n" not in out["line"]
    jsonschema.validate(out, schema())


def test_bad_pipeline_settings_are_named() -> None:
    with pytest.raises(ValueError, match="schedule must be one of"):
        PipelineSetting(schedule="PipeDream", scale_grads=True, loss="mean")
    with pytest.raises(ValueError, match="loss must be one of"):
        PipelineSetting(schedule="GPipe", scale_grads=True, loss="sum")
    with pytest.raises(ValueError, match="n_microbatches must be a positive int, got 0"):
        PipelineSetting(schedule="GPipe", scale_grads=True, loss="mean", n_microbatches=0)
    with pytest.raises(ValueError, match=r"batch_size \(3\) must be at least n_microbatches \(4\)"):
        PipelineSetting(schedule="GPipe", scale_grads=True, loss="mean", batch_size=3)
