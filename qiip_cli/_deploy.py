"""`qiip deploy …` and `qiip host …`: deployments and the host pool, through the daemon's admin API.

A deployment file is checked here first, field by field (the same rules the daemon applies), so a mistake is one
line per field before anything is sent; the daemon then checks what only it knows (the artifact, the hub's commit,
the sizing against the model) and answers the same way.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import tomllib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import click
from pydantic import ValidationError

from qiip_cli._context import CliContext, pass_cli
from qiip_core import DeploymentInvalid, QiipError
from qiip_core.client import ApiError, QiipClient, load_console_config
from qiip_core.config import HostSpec
from qiip_core.deployments import parse_spec
from qiip_core.nodes import PROVISIONED_ENGINES

__all__ = ["deploy", "host"]

T = TypeVar("T")

_URL = click.option("--url", default=None, help="The daemon's URL (default: QIIP_URL, then the console config).")
_GPU_RE = re.compile(r"^(?P<product>[^:]+):(?P<mib>\d+)(?:x(?P<count>\d+))?$")


def _fail(lines: list[str]) -> None:
    for line in lines:
        click.echo(f"error: {line}", err=True)
    sys.exit(1)


def _call(
    ctx: CliContext,
    url: str | None,
    work: Callable[[QiipClient], Awaitable[T]],
    *,
    timeout_s: float = 60.0,
    flags: Mapping[str, str] | None = None,
) -> T:
    """Run `work` against the daemon; a refusal becomes one `error:` line per field at fault (a field the command
    sets from a flag named as `flags` spells it) and exit status 1."""
    config_state = ctx.settings.state_dir
    try:
        config = load_console_config(url=url, state_dir=config_state)

        async def run() -> T:
            async with QiipClient.from_config(config, timeout_s=timeout_s) as client:
                return await work(client)

        return asyncio.run(run())
    except ApiError as exc:
        _fail(exc.lines(flags))
    except QiipError as exc:
        _fail([exc.message])
    raise AssertionError("unreachable")  # pragma: no cover


def _read_document(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        _fail([f"{path} cannot be read: {exc.strerror}."])
    try:
        if path.suffix == ".json" or raw.lstrip()[:1] == b"{":
            data = json.loads(raw)
        else:
            data = tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        _fail([f"{path} is neither TOML nor JSON: {exc}."])
    if not isinstance(data, dict):
        _fail([f"{path} must hold one deployment: a TOML document or a JSON object."])
    document: dict[str, Any] = data
    return document


@click.group()
def deploy() -> None:
    """Deployments: declare a model and its replicas; QIIP places, provisions and keeps them."""


@deploy.command("apply")
@click.option(
    "-f", "--file", "path", type=click.Path(path_type=Path, dir_okay=False), required=True, help="TOML or JSON."
)
@click.option("--generation", type=click.IntRange(0), default=None, help="Apply only over this generation (0: new).")
@_URL
@pass_cli
def apply(ctx: CliContext, path: Path, generation: int | None, url: str | None) -> None:
    """Create or change the deployment FILE describes (docs/deployments.md)."""
    data = _read_document(path)
    try:
        parse_spec(data)
    except DeploymentInvalid as exc:
        _fail([f"{path}: {v.line()}" for v in exc.violations] or [f"{path}: {exc.message}"])
    result = _call(ctx, url, lambda c: c.apply_deployment(data, generation=generation), timeout_s=120.0)
    name, gen = result["name"], result["generation"]
    if not result.get("changed", True):
        click.echo(f"{name}: unchanged (generation {gen})")
    else:
        template = result["template"]
        click.echo(
            f"{name}: generation {gen} applied: {result['spec']['replicas']} replica(s) of template {template['hash']} "
            f"({template['source'].get('describe') or template['source']['model']})"
        )


def _condition(status: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    return next((c for c in (status or {}).get("conditions", []) if c["type"] == kind), None)


def _health(status: dict[str, Any] | None) -> str:
    if status is None:
        return "not yet observed"
    progressing = _condition(status, "Progressing")
    degraded = _condition(status, "Degraded")
    if progressing is not None and not progressing["status"]:
        return str(progressing["reason"])
    if degraded is not None and degraded["status"]:
        return str(degraded["reason"])
    return "Available"


@deploy.command("plan")
@click.option(
    "-f", "--file", "path", type=click.Path(path_type=Path, dir_okay=False), required=True, help="TOML or JSON."
)
@click.option("--requests-per-s", type=click.FloatRange(min=0, min_open=True), required=True, help="Average load.")
@click.option("--prompt-tokens", type=click.IntRange(1), required=True, help="Tokens of a typical prompt.")
@click.option("--answer-tokens", type=click.IntRange(1), required=True, help="Tokens of a typical answer.")
@click.option(
    "--tokens-per-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Answer tokens per second of one sequence (default: measured on the running fleet's replicas).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's JSON.")
@_URL
@pass_cli
def plan(
    ctx: CliContext,
    path: Path,
    requests_per_s: float,
    prompt_tokens: int,
    answer_tokens: int,
    tokens_per_s: float | None,
    as_json: bool,
    url: str | None,
) -> None:
    """How many replicas, on which hosts of the pool, FILE's deployment needs for a load; applies nothing."""
    data = _read_document(path)
    try:
        parse_spec(data)
    except DeploymentInvalid as exc:
        _fail([f"{path}: {v.line()}" for v in exc.violations] or [f"{path}: {exc.message}"])
    load = {"requests_per_s": requests_per_s, "prompt_tokens": prompt_tokens, "answer_tokens": answer_tokens}
    result = _call(
        ctx,
        url,
        lambda c: c.plan_deployment(data, load, tokens_per_s=tokens_per_s),
        timeout_s=300.0,
        flags={**_PLAN_FLAGS, **{f"load.{field}": flag for field, flag in _PLAN_FLAGS.items()}},
    )
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        _print_plan(result, requests_per_s)
    for line in [*result["warnings"], *([result["shortfall"]] if result["shortfall"] else [])]:
        click.echo(f"warning: {line}", err=True)
    if result["shortfall"]:
        sys.exit(1)


_PLAN_FLAGS = {
    "requests_per_s": "--requests-per-s",
    "prompt_tokens": "--prompt-tokens",
    "answer_tokens": "--answer-tokens",
    "tokens_per_s": "--tokens-per-s",
}
"""`POST /admin/deployments/plan`'s fields, as `qiip deploy plan` spells them."""


def _print_plan(result: dict[str, Any], requests_per_s: float) -> None:
    decode = result["decode"]
    click.echo(
        f"{result['name']}: {result['replicas']} replica(s), {result['slots']} slot(s) for "
        f"{result['sequences']:g} sequence(s) in flight ({requests_per_s:g} request(s)/s × "
        f"{result['seconds_per_request']:g} s each at {decode['tokens_per_s']:g} tokens/s ({decode['source']}), "
        f"{result['target']:g} of each slot busy)"
    )
    for host in result["hosts"]:
        context = f" × {host['context_per_slot']:,} tokens" if host["context_per_slot"] else ""
        click.echo(f"  ✔ {host['host']}  {host['slots']} slot(s){context}")
    for name, reasons in sorted(result["refused"].items()):
        click.echo(f"  ✘ {name}  {'; '.join(reasons)}")


@deploy.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's JSON.")
@_URL
@pass_cli
def list_deployments(ctx: CliContext, as_json: bool, url: str | None) -> None:
    """Every deployment: replicas ready of desired, updated, generation, state."""
    found = _call(ctx, url, lambda c: c.deployments())
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    if not found:
        click.echo("no deployment")
        return
    rows = [("NAME", "ENGINE", "READY", "UPDATED", "GEN", "STATE", "SOURCE")]
    for d in found:
        status = d.get("status") or {}
        ready = f"{status.get('ready', 0)}/{status.get('desired', d['spec']['replicas'])}"
        state = "Deleting" if d.get("deleting") else _health(d.get("status"))
        source = d["template"]["source"].get("describe") or d["template"]["source"]["model"]
        rows.append(
            (d["name"], d["spec"]["engine"], ready, str(status.get("updated", 0)), str(d["generation"]), state, source)
        )
    _table(rows)


def _table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _when(text: str) -> str:
    return datetime.fromisoformat(text).strftime("%H:%M:%S")


def _event_line(event: dict[str, Any]) -> str:
    return f"{_when(event['at'])}  {event['kind']:<13} {event['message']}"


@deploy.command("status")
@click.argument("name")
@click.option("--follow", "-f", is_flag=True, help="Then print each new event until interrupted.")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's JSON.")
@_URL
@pass_cli
def status(ctx: CliContext, name: str, follow: bool, as_json: bool, url: str | None) -> None:
    """A deployment: its replicas, conditions and recent events."""
    found = _call(ctx, url, lambda c: c.deployment(name))
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    st = found.get("status") or {}
    click.echo(
        f"{found['name']}: generation {found['generation']} (observed {st.get('observed_generation', 0)}), "
        f"{st.get('ready', 0)}/{st.get('desired', found['spec']['replicas'])} ready, {st.get('updated', 0)} updated, "
        f"template {found['template']['hash']}" + (" — deleting" if found.get("deleting") else "")
    )
    for c in st.get("conditions", []):
        click.echo(f"  {c['type']:<12} {str(c['status']).lower():<5} {c['reason']}: {c.get('message', '')}")
    if st.get("replicas"):
        rows = [("HOST", "STATE", "TEMPLATE", "SINCE", "REASON")]
        for r in st["replicas"]:
            reason = r.get("retiring") or r.get("reason") or ""
            rows.append((r["host"], r["state"], r["template"], _when(r["since"]), reason))
        _table(rows)
    auto = st.get("autoscale") or {}
    if auto.get("recommendation") is not None:
        click.echo(f"  autoscale: {auto.get('recommendation')} recommended ({auto.get('reason')})")
    last = 0
    for event in st.get("events", [])[-10:]:
        click.echo(_event_line(event))
        last = event["seq"]
    if not follow:
        return

    async def tail(client: QiipClient) -> None:
        try:
            async for event in client.deployment_events(name, after=last):
                click.echo(_event_line(event))
        except ApiError as exc:
            # Removed between the status above and the stream's start: what following it would have ended on.
            if exc.status != 404 or exc.code != "deployment_not_found":
                raise

    try:
        _call(ctx, url, tail, timeout_s=60.0)
    except KeyboardInterrupt:
        pass


@deploy.command("scale")
@click.argument("name")
@click.argument("replicas", type=click.IntRange(0, 1000))
@_URL
@pass_cli
def scale(ctx: CliContext, name: str, replicas: int, url: str | None) -> None:
    """Set NAME's replica count."""
    result = _call(ctx, url, lambda c: c.scale_deployment(name, replicas))
    click.echo(f"{name}: {replicas} replica(s) (generation {result['generation']})")


@deploy.command("rollout")
@click.argument("words", nargs=-1, required=True)
@click.option("--artifact", default=None, help="A GGUF generation of the shared cache: its id or a unique prefix.")
@click.option("--hub", default=None, help="REPO[:FILE][@REVISION]: a hub repository (vLLM) or file (llama.cpp).")
@click.option(
    "--runtime",
    default=None,
    help='The runtime as JSON, e.g. \'{"capacity": {"sequences": 4, "context_tokens": 8192}}\'.',
)
@click.option("--engine", type=click.Choice([engine.value for engine in PROVISIONED_ENGINES]), default=None)
@_URL
@pass_cli
def rollout(
    ctx: CliContext,
    words: tuple[str, ...],
    artifact: str | None,
    hub: str | None,
    runtime: str | None,
    engine: str | None,
    url: str | None,
) -> None:
    """Roll NAME out to a new source, runtime or engine (`rollout NAME --artifact ID`), or go back to the previous
    template (`rollout undo NAME`)."""
    if words[0] == "undo":
        if len(words) != 2:
            _fail(["usage: qiip deploy rollout undo NAME"])
        name = words[1]
        result = _call(ctx, url, lambda c: c.rollout_undo(name))
        click.echo(f"{name}: back to template {result['template']['hash']} (generation {result['generation']})")
        return
    if len(words) != 1:
        _fail(
            ["usage: qiip deploy rollout NAME [--artifact ID | --hub REPO[:FILE][@REV]] [--runtime JSON] [--engine E]"]
        )
    name = words[0]
    changes: dict[str, Any] = {}
    if artifact and hub:
        _fail(["give --artifact or --hub, not both"])
    if artifact:
        changes["source"] = {"artifact": artifact}
    if hub:
        repo, _, revision = hub.partition("@")
        repo, _, file = repo.partition(":")
        source: dict[str, Any] = {"repo": repo}
        if file:
            source["file"] = file
        if revision:
            source["revision"] = revision
        changes["source"] = {"hub": source}
    if runtime:
        try:
            changes["runtime"] = json.loads(runtime)
        except ValueError as exc:
            _fail([f"--runtime is not JSON: {exc}."])
    if engine:
        changes["engine"] = engine
    if not changes:
        _fail(["a rollout changes something: give --artifact, --hub, --runtime or --engine"])
    result = _call(ctx, url, lambda c: c.rollout(name, changes), timeout_s=120.0)
    click.echo(f"{name}: rolling out template {result['template']['hash']} (generation {result['generation']})")


@deploy.command("explain")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's JSON.")
@_URL
@pass_cli
def explain(ctx: CliContext, name: str, as_json: bool, url: str | None) -> None:
    """Why the last placement of NAME chose its hosts, and why every other host was not chosen."""
    found = _call(ctx, url, lambda c: c.explain(name))
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    if found.get("hosts") is None:
        click.echo(f"{name}: nothing placed yet")
        return
    chosen = sum(1 for h in found["hosts"] if h["chosen"])
    at, wanted = _when(found["at"]), found["wanted"]
    click.echo(f"{name}: placed {chosen} of {wanted} replica(s) of template {found['template']} at {at}")
    for h in found["hosts"]:
        if h["eligible"]:
            mark = "✔" if h["chosen"] else "·"
            click.echo(f"  {mark} {h['host']}  score {h['score']}  " + "; ".join(h["reasons"]))
        else:
            click.echo(f"  ✘ {h['host']}  " + "; ".join(h["reasons"]))


@deploy.command("delete")
@click.argument("name")
@_URL
@pass_cli
def delete(ctx: CliContext, name: str, url: str | None) -> None:
    """Delete NAME: its replicas are drained and torn down, then it goes (`status --follow` shows it)."""
    _call(ctx, url, lambda c: c.delete_deployment(name))
    click.echo(f"{name}: deleting (its replicas drain, then are torn down)")


@click.group()
def host() -> None:
    """The host pool deployments place replicas on."""


def _field_line(error: Any) -> str:
    """One line of a pydantic error: the field (as the option that sets it) and the reason."""
    field = ".".join(str(p) for p in error["loc"]) or "host"
    option = {"name": "NAME", "labels": "--label", "gpus": "--gpu", "memory_mib": "--memory-mib"}
    head = option.get(str(error["loc"][0]), field) if error["loc"] else field
    return f"{head} ({field}): {str(error['msg']).removeprefix('Value error, ')}"


def _gpus(values: tuple[str, ...]) -> list[dict[str, Any]]:
    found = []
    for value in values:
        match = _GPU_RE.match(value)
        if match is None:
            _fail([f"--gpu {value!r} is not PRODUCT:MEMORY_MIB[xCOUNT], such as 'NVIDIA L40S:46068x4'"])
            raise AssertionError
        found.append({"product": match["product"], "memory_mib": int(match["mib"]), "count": int(match["count"] or 1)})
    return found


@host.command("add")
@click.argument("name")
@click.option("--label", "labels", multiple=True, help="KEY=VALUE (repeatable).")
@click.option("--gpu", "gpus", multiple=True, help="PRODUCT:MEMORY_MIB[xCOUNT] (repeatable).")
@click.option("--memory-mib", type=click.IntRange(1), default=None, help="Its RAM (what the cpu profile plans on).")
@_URL
@pass_cli
def add_host(
    ctx: CliContext, name: str, labels: tuple[str, ...], gpus: tuple[str, ...], memory_mib: int | None, url: str | None
) -> None:
    """Add NAME to the pool (or replace what was declared of it)."""
    body: dict[str, Any] = {"name": name}
    pairs = {}
    for label in labels:
        key, sep, value = label.partition("=")
        if not sep:
            _fail([f"--label {label!r} is not KEY=VALUE"])
        pairs[key] = value
    if pairs:
        body["labels"] = pairs
    if gpus:
        body["gpus"] = _gpus(gpus)
    if memory_mib is not None:
        body["memory_mib"] = memory_mib
    try:
        HostSpec.model_validate(body)  # the daemon's rules, checked before anything is sent
    except ValidationError as exc:
        _fail([_field_line(error) for error in exc.errors()])
    added = _call(ctx, url, lambda c: c.add_host(body))
    click.echo(f"{added['name']} is in the pool")


@host.command("remove")
@click.argument("name")
@_URL
@pass_cli
def remove_host(ctx: CliContext, name: str, url: str | None) -> None:
    """Remove NAME from the pool (a replica there is moved to another host by its deployment)."""
    _call(ctx, url, lambda c: c.remove_host(name))
    click.echo(f"{name} left the pool")


@host.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's JSON.")
@_URL
@pass_cli
def list_hosts(ctx: CliContext, as_json: bool, url: str | None) -> None:
    """The pool: each host's GPUs, QUADS window, occupant and last failure."""
    found = _call(ctx, url, lambda c: c.hosts())
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    if not found:
        click.echo("the pool is empty: add hosts with [[hosts]] or `qiip host add`")
        return
    rows = [("HOST", "FROM", "GPUS", "QUADS", "OCCUPANT", "LABELS")]
    for h in found:
        gpus = h["gpus"]
        if gpus:
            described = f"{len(gpus)}× {gpus[0]['product']} ({h['gpus_from']})"
        elif h.get("memory_mib"):
            described = f"RAM {h['memory_mib']:,} MiB"
        else:
            described = "unknown"
        quads = h.get("quads") or {}
        window = quads.get("state", "")
        if quads.get("conflict_at"):
            window += f" from {quads['conflict_at'][:16].replace('T', ' ')}"
        occupant = (h.get("occupant") or {}).get("describe", "free")
        labels = ",".join(f"{k}={v}" for k, v in sorted(h.get("labels", {}).items()))
        rows.append((h["name"], h["origin"], described, window, occupant, labels))
    _table(rows)
