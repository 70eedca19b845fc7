"""`qiip up`'s planning of local nodes in the core, its default sizing, and its hand-off to the daemon."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from qiip_core import ConfigError, PlanError
from qiip_core.config import LOCAL_NODE_PLAN_VARIABLE
from qiip_core.engines.llamacpp import (
    LOCAL_NODE_HANDOFF_VERSION,
    InstalledEngine,
    LocalModel,
    LocalNodeHandoff,
    LocalNodePlan,
    RelaunchedSizings,
    default_local_policy,
    plan_local_nodes,
    share_devices,
)
from qiip_core.planner import AutoPolicy, CustomPolicy, DeviceMemory

ROOMY = [DeviceMemory(index=0, name="CPU", total_mib=64_000, free_mib=60_000, kind="cpu")]
TIGHT = [DeviceMemory(index=0, name="CPU", total_mib=2_000, free_mib=600, kind="cpu")]
ARTIFACT = "ab" * 32
SIZING = {"sizing": "custom", "fit_target_mib": 512, "context_per_slot": 2048, "slots": 2, "cache_type": "f16"}


@pytest.fixture
def engine(tmp_path: Path) -> InstalledEngine:
    """A CPU build as planning sees it (nothing is launched)."""
    return InstalledEngine(
        root=tmp_path, server=tmp_path / "llama-server", fit_params=None, quantize=None, version="0.3.36", variant="cpu"
    )


def test_the_default_local_sizing_is_two_slots_of_the_training_context_up_to_4096_tokens() -> None:
    assert default_local_policy(2048) == CustomPolicy(
        fit_target_mib=512, context_per_slot=2048, slots=2, cache_type="f16"
    )
    assert default_local_policy(131_072).context_per_slot == 4096
    assert default_local_policy(1000).context_per_slot == 768  # aligned down to 256
    assert default_local_policy(100).context_per_slot == 256  # never below 256
    given = default_local_policy(8192, slots=3, context_per_slot=1024, cache_type="q8_0", fit_target_mib=0)
    assert (given.slots, given.context_per_slot, given.cache_type, given.fit_target_mib) == (3, 1024, "q8_0", 0)


def test_plan_local_nodes_plans_each_model_under_its_own_id(engine: InstalledEngine, tiny_gguf: Path) -> None:
    models = [LocalModel("a", tiny_gguf), LocalModel("b", tiny_gguf, artifact_id=ARTIFACT)]
    first, second = plan_local_nodes(engine, models, devices=ROOMY)
    assert first.node == LocalNodePlan(
        id="local", model="a", gguf=tiny_gguf, sizing=default_local_policy(2048), embeddings=False
    )
    assert (second.node.id, second.node.artifact_id, second.node.gguf) == ("local-2", ARTIFACT, tiny_gguf)
    assert (first.plan.slots, first.plan.context_per_slot) == (2, 2048)
    # The second is planned against what the first leaves.
    assert second.plan.devices[0].free_mib < first.plan.devices[0].free_mib


def test_automatic_plans_of_several_models_share_the_memory_and_launch_as_planned(
    engine: InstalledEngine, tiny_gguf: Path
) -> None:
    (alone,) = plan_local_nodes(engine, [LocalModel("a", tiny_gguf)], sizing="auto", devices=ROOMY)
    assert alone.node.sizing == AutoPolicy()  # planned again at launch
    both = plan_local_nodes(
        engine, [LocalModel("a", tiny_gguf), LocalModel("b", tiny_gguf)], sizing="auto", devices=ROOMY
    )
    for each in both:
        assert each.node.sizing == CustomPolicy(
            fit_target_mib=512, context_per_slot=each.plan.context_per_slot, slots=each.plan.slots, cache_type="f16"
        )


def test_several_automatic_plans_share_what_is_free_beyond_the_target() -> None:
    device = DeviceMemory(index=0, name="CPU", total_mib=24000, free_mib=23000, kind="cpu")
    (one,) = share_devices([device], fit_target_mib=21000, models=2)
    # Each of two sees the target and half of the 2,000 MiB beyond it: together they leave 21,000 free.
    assert one.free_mib == 22000
    assert share_devices([device], fit_target_mib=21000, models=1) == [device]
    (starved,) = share_devices([replace(device, free_mib=500)], fit_target_mib=512, models=3)
    assert starved.free_mib == 500


def test_a_recorded_relaunch_is_planned_as_the_daemon_will_launch_it_and_left_as_it_is(
    engine: InstalledEngine, tiny_gguf: Path, tmp_path: Path
) -> None:
    records = RelaunchedSizings(tmp_path)
    (configured,) = plan_local_nodes(engine, [LocalModel("a", tiny_gguf)], devices=ROOMY, relaunched=records)
    assert configured.relaunch is None and configured.launched == configured.node.sizing
    relaunch = CustomPolicy(fit_target_mib=512, context_per_slot=1024, slots=3, cache_type="f16")
    records.remember(configured.node.config(), relaunch)

    (again,) = plan_local_nodes(engine, [LocalModel("a", tiny_gguf)], devices=ROOMY, relaunched=records)
    assert again.node == configured.node  # the daemon still compares the record with the configured sizing
    assert again.relaunch is not None and again.relaunch_refused is None and again.launched == relaunch
    assert (again.plan.slots, again.plan.context_per_slot, again.plan.cache_type_k) == (3, 1024, "f16")

    records.remember(configured.node.config(), relaunch.model_copy(update={"slots": 256, "context_per_slot": 2048}))
    (tight,) = plan_local_nodes(engine, [LocalModel("a", tiny_gguf)], devices=TIGHT, relaunched=records)
    assert tight.relaunch_refused is not None and "does not fit" in tight.relaunch_refused
    assert tight.launched == configured.node.sizing and tight.plan.slots == 2
    written = records.path.read_text()

    # Another configuration: the record does not apply; only the daemon's `recall` drops it.
    (other,) = plan_local_nodes(engine, [LocalModel("a", tiny_gguf)], slots=1, devices=ROOMY, relaunched=records)
    assert other.relaunch is None and other.plan.slots == 1
    assert records.path.read_text() == written


def test_a_sizing_that_does_not_fit_names_the_file_in_the_callers_words(
    engine: InstalledEngine, tiny_gguf: Path
) -> None:
    models = [LocalModel("a", tiny_gguf)]
    with pytest.raises(PlanError) as keys:
        plan_local_nodes(engine, models, slots=256, context_per_slot=2048, devices=TIGHT)
    assert keys.value.message.startswith("tiny.gguf: The custom sizing (256 slots of 2048 tokens, f16 K/V) does not")
    assert keys.value.message.endswith(
        "Lower context_per_slot or slots, use cache_type 'q8_0', lower fit_target_mib, or set allow_estimator_overrun "
        "if you know the estimate is pessimistic."
    )
    flags = {"context_per_slot": "--ctx-size", "slots": "--slots", "cache_type": "--cache-type"}
    with pytest.raises(PlanError) as named:
        plan_local_nodes(engine, models, slots=256, context_per_slot=2048, devices=TIGHT, names=flags)
    # Advice to set a field the caller has no name for (allow_estimator_overrun) is left out.
    assert named.value.message.endswith("Lower --ctx-size or --slots, use --cache-type q8_0, lower fit_target_mib.")
    with pytest.raises(PlanError) as rule:
        plan_local_nodes(engine, models, context_per_slot=1000, devices=ROOMY, names=flags)
    assert [v.field for v in rule.value.violations] == ["context_per_slot"]
    assert (
        "tiny.gguf: The sizing policy is invalid: --ctx-size must be a positive multiple of 256" in rule.value.message
    )


def test_a_file_that_cannot_be_served_is_refused_before_any_plan(engine: InstalledEngine, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="absent.gguf does not exist"):
        plan_local_nodes(engine, [LocalModel("a", tmp_path / "absent.gguf")], devices=ROOMY)


def test_a_fifo_given_as_the_model_is_refused_without_opening_it(engine: InstalledEngine, tmp_path: Path) -> None:
    fifo = tmp_path / "x.gguf"
    os.mkfifo(fifo)
    (tmp_path / "link.gguf").symlink_to(fifo)
    for given in (fifo, tmp_path / "link.gguf"):
        # Opening it would wait for a writer forever: this returns at once.
        with pytest.raises(ValueError, match=f"The model path {given} is not a regular file"):
            plan_local_nodes(engine, [LocalModel("a", given)], devices=ROOMY)


def test_the_planned_file_is_handed_on_as_an_absolute_path(
    engine: InstalledEngine, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tiny_gguf.parent)
    (planned,) = plan_local_nodes(engine, [LocalModel("a", Path(tiny_gguf.name))], devices=ROOMY)
    assert planned.node.gguf == tiny_gguf


def _handoff(tiny_gguf: Path, engine: InstalledEngine) -> LocalNodeHandoff:
    return LocalNodeHandoff(
        version=LOCAL_NODE_HANDOFF_VERSION,
        engine=engine,
        nodes=[
            LocalNodePlan(id="local", model="a", gguf=tiny_gguf, sizing=AutoPolicy(), embeddings=False),
            LocalNodePlan(
                id="local-2",
                model="b",
                gguf=tiny_gguf,
                artifact_id=ARTIFACT,
                sizing=default_local_policy(2048),
                embeddings=True,
            ),
        ],
    )


def test_the_handoff_reads_back_as_written(engine: InstalledEngine, tiny_gguf: Path) -> None:
    handoff = _handoff(tiny_gguf, engine)
    assert LocalNodeHandoff.from_environ({LOCAL_NODE_PLAN_VARIABLE: handoff.to_json()}) == handoff
    assert LocalNodeHandoff.from_environ({}) is None
    # As the daemon's settings hold them: a file, or the artifact's whole id, and the sizing as a policy table.
    file_node, artifact_node = (node.config() for node in handoff.nodes)
    assert (file_node.gguf, file_node.artifact_id, file_node.sizing) == (
        tiny_gguf,
        None,
        {"sizing": "auto", "fit_target_mib": 512},
    )
    assert (artifact_node.gguf, artifact_node.artifact_id, artifact_node.embeddings) == (None, ARTIFACT, True)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"version": 2}, "has version 2; this daemon reads version 1"),
        ({"version": None}, "has version None"),
        ({"nodes": []}, "is invalid: nodes: List should have at least 1 item"),
        ({"node": 1}, "is invalid: node: Extra inputs are not permitted"),
        ({"version": True}, "is invalid: version: must be the integer 1, got True."),
        ({"version": 1.0}, "is invalid: version: must be the integer 1, got 1.0."),
    ],
)
def test_a_handoff_of_another_version_or_shape_is_refused_naming_the_variable(
    engine: InstalledEngine, tiny_gguf: Path, change: dict[str, object], expected: str
) -> None:
    data = json.loads(_handoff(tiny_gguf, engine).to_json()) | change
    with pytest.raises(ConfigError) as refused:
        LocalNodeHandoff.from_environ({LOCAL_NODE_PLAN_VARIABLE: json.dumps(data)})
    assert refused.value.message.startswith("QIIP_LOCAL_NODE_PLAN (the local nodes `qiip up` hands the daemon)")
    assert expected in refused.value.message


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("id", "-x", "nodes.1.id: String should match pattern"),
        ("artifact_id", "abc", "nodes.1.artifact_id: String should match pattern"),
        ("sizing", {"sizing": "custom", "slots": "2"}, "nodes.1.sizing.custom."),
        ("id", "local", "the record: node id"),  # two nodes under one id
        ("model", "a\x07b", "nodes.1.model: model must be printable with no surrounding whitespace."),
        ("model", "a ", "nodes.1.model: model must be printable"),
        ("gguf", "", "nodes.1.gguf: is empty; it must be the absolute path of a file."),
        ("gguf", "tiny.gguf", "nodes.1.gguf: is relative ('tiny.gguf'); it must be an absolute path."),
        ("gguf", "/m/a\x00b.gguf", "nodes.1.gguf: holds a NUL byte or control character ('/m/a\\x00b.gguf')"),
        ("gguf", "/m/a\nb.gguf", "nodes.1.gguf: holds a NUL byte or control character ('/m/a\\nb.gguf')"),
        # The planner's own rules, those that need no model.
        ("sizing", {**SIZING, "slots": 0}, "nodes.1.sizing: slots must be between 1 and 256, got 0."),
        ("sizing", {**SIZING, "context_per_slot": 100}, "nodes.1.sizing: context_per_slot must be a positive multiple"),
        ("sizing", {**SIZING, "fit_target_mib": -1}, "nodes.1.sizing: fit_target_mib must be at least 0 MiB, got -1."),
    ],
)
def test_a_bad_field_of_the_handoff_is_refused_naming_it(
    engine: InstalledEngine, tiny_gguf: Path, field: str, value: object, expected: str
) -> None:
    data = json.loads(_handoff(tiny_gguf, engine).to_json())
    data["nodes"][1][field] = value
    with pytest.raises(ConfigError, match="QIIP_LOCAL_NODE_PLAN") as refused:
        LocalNodeHandoff.from_environ({LOCAL_NODE_PLAN_VARIABLE: json.dumps(data)})
    assert expected in refused.value.message
    assert "\n" not in refused.value.message


@pytest.mark.parametrize(
    ("server", "expected"),
    [
        (None, "engine.server: Field required."),
        ("", "engine.server: is empty"),
        ("bin/x", "engine.server: is relative"),
    ],
)
def test_a_handoff_without_the_engines_server_is_refused(
    engine: InstalledEngine, tiny_gguf: Path, server: str | None, expected: str
) -> None:
    data = json.loads(_handoff(tiny_gguf, engine).to_json())
    data["engine"].pop("server")
    if server is not None:
        data["engine"]["server"] = server
    with pytest.raises(ConfigError, match="QIIP_LOCAL_NODE_PLAN") as refused:
        LocalNodeHandoff.from_environ({LOCAL_NODE_PLAN_VARIABLE: json.dumps(data)})
    assert expected in refused.value.message


def test_a_handoff_that_is_not_json_is_refused(engine: InstalledEngine) -> None:
    with pytest.raises(ConfigError, match="QIIP_LOCAL_NODE_PLAN .* is not JSON"):
        LocalNodeHandoff.from_environ({LOCAL_NODE_PLAN_VARIABLE: "[{"})
    with pytest.raises(ConfigError, match="QIIP_LOCAL_NODE_PLAN .* its JSON nests too deeply to read"):
        LocalNodeHandoff.from_environ({LOCAL_NODE_PLAN_VARIABLE: "[" * 1500})
