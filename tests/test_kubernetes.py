"""scripts/kubernetes/: every manifest validates offline against the schemas of a current Kubernetes
release (kubernetes-validate, strict: unknown fields fail too); KEDA's ScaledObjects, whose CRD
those schemas lack, are checked field by field instead. Every container's args, expanded the way
the kubelet expands `$(VAR)`, pass rill's real parser; the KEDA triggers name the streams and
consumer groups Rill's code uses; the dashboard and scrape config use only series /metrics
exports. Last, the containers' commands run as local processes against the test Redis (no
cluster here), with the broker URL and API key from the environment as in the pods."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import secrets
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import yaml
from prometheus_client.parser import text_string_to_metric_families
from service_stack import ServiceStack, count_chats, rill_executable, stack_flags

from rill.services.cli import build_parser
from rill.services.gateway import info_api
from rill.services.gateway import metrics as gateway_metrics
from rill.services.gateway.metrics import GatewayMetrics, GroupBacklog
from rill.shared.broker import free_port
from rill.shared.schema import EngineStats
from rill.shared.streams import DETOKENIZER_GROUP, TOKENIZER_GROUP

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "scripts" / "kubernetes"
RILL_IMAGE = "rill"  # rill:latest and rill:cuda, built from scripts/Dockerfile (ENTRYPOINT ["rill"])
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# prometheus trigger fields in KEDA's docs (keda.sh/docs/latest/scalers/prometheus).
KEDA_PROMETHEUS = {"serverAddress", "query", "threshold", "activationThreshold", "namespace", "customHeaders",
                   "ignoreNullValues", "queryParameters", "unsafeSsl", "timeout"}


@functools.cache
def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@functools.cache
def manifests() -> list[dict[str, Any]]:
    docs = []
    for name in kustomization()["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    return docs


def find(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name)


def workloads() -> list[dict[str, Any]]:
    return [d for d in manifests() if d["kind"] in ("Deployment", "StatefulSet")]


def rill_containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) of every container that runs Rill's image."""
    return [(w, c) for w in workloads() for c in w["spec"]["template"]["spec"]["containers"]
            if c["image"].split(":")[0] == RILL_IMAGE]


def container_env(container: dict[str, Any], pod_index: int = 0) -> dict[str, str]:
    """The environment the kubelet gives the container: its envFrom ConfigMaps, then env entries
    (a pod-index fieldRef as `pod_index`; a Secret's value as a placeholder)."""
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        env.update(find("ConfigMap", src["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == POD_INDEX:
            env[var["name"]] = str(pod_index)
        else:
            env[var["name"]] = f"<{var['name']} from a Secret>"
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion of command and args: defined variables are replaced,
    `$$` is a literal `$`, undefined references stay as written."""
    return VAR_REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


def rendered_args(container: dict[str, Any], pod_index: int = 0) -> list[str]:
    env = container_env(container, pod_index)
    return [expand(str(a), env) for a in container["args"]]


def test_kustomization_lists_every_manifest() -> None:
    listed = set(kustomization()["resources"])
    beside = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "prometheus.yaml"}
    assert listed == beside, f"kustomization.yaml resources {sorted(listed)} vs files {sorted(beside)}"
    namespace = kustomization()["namespace"]
    assert find("Namespace", namespace)
    assert all("namespace" not in d["metadata"] for d in manifests()), "kustomize sets the namespace"


def test_manifests_validate_against_kubernetes_schemas() -> None:
    version = kubernetes_validate.latest_version()
    major, minor = (int(x) for x in version.split(".")[:2])
    assert (major, minor) >= (1, 33), f"kubernetes-validate's newest schemas are old: {version}"
    checked = set()
    for doc in manifests():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: not in Kubernetes' schemas (test_keda_scales_replicas_on_rills_streams)
        kubernetes_validate.validate(doc, version, strict=True)
        checked.add(doc["kind"])
    assert checked >= {"Namespace", "ConfigMap", "PersistentVolumeClaim", "StatefulSet", "Deployment", "Service"}


def test_container_args_pass_rills_parser() -> None:
    seen: dict[str, list[Any]] = {}
    for workload, c in rill_containers():
        assert "command" not in c, "args only: the image's entrypoint `rill` must run them"
        args = rendered_args(c)
        assert not any("$(" in a for a in args), f"{c['name']}: an undefined variable in {c['args']}"
        ns = build_parser().parse_args(args)  # exactly what the container runs after `rill`
        assert (ns.command, ns.name) == ("service", c["name"])
        # The broker URL (it may hold a password) comes from the environment, off the command line.
        assert ns.redis_url is None and urlsplit(container_env(c)["RILL_REDIS_URL"]).scheme in ("redis", "rediss")
        assert {m["mountPath"] for m in c["volumeMounts"]} == {"/models"}
        seen.setdefault(ns.name, []).append((workload, c, ns))
    assert sorted(seen) == sorted(["gateway", "tokenizer", "detokenizer", "scheduler", "worker"])

    # Engines: scheduler and worker of one pod share the engine id, the pod's ordinal.
    (engine, worker, wns), = seen["worker"]
    (engine2, scheduler, sns), = seen["scheduler"]
    assert engine is engine2 and engine["kind"] == "StatefulSet" and engine["spec"]["replicas"] >= 2
    for index in (0, 3):
        assert (build_parser().parse_args(rendered_args(worker, index)).engine_id
                == build_parser().parse_args(rendered_args(scheduler, index)).engine_id == index)
    assert wns.device == "cuda" and wns.role == sns.role == "both"
    # The CUDA build of the image, as scripts/compose.gpu.yaml builds it for its worker.
    gpu_compose = yaml.safe_load((ROOT / "scripts" / "compose.gpu.yaml").read_text())["services"]["worker"]
    assert worker["image"] == gpu_compose["image"] and gpu_compose["build"]["args"]["TORCH_VARIANT"] == "cuda"
    gpus = worker["resources"]
    assert gpus["requests"]["nvidia.com/gpu"] == gpus["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in scheduler["resources"].get("requests", {})

    # Gateway: its port behind the Service, /health as the readiness probe, the key from a Secret.
    (gw, gateway, gns), = seen["gateway"]
    port = next(p for p in gateway["ports"] if p["name"] == "http")
    assert gns.port == port["containerPort"] and gns.host == "0.0.0.0"
    service = find("Service", gw["metadata"]["name"])
    assert service["spec"]["selector"] == gw["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    probe = gateway["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and probe["port"] == "http"
    assert "/health" in {r.path for r in info_api.routes()}
    assert gns.api_key is None
    key = next(v for v in gateway["env"] if v["name"] == "RILL_API_KEY")
    assert "secretKeyRef" in key["valueFrom"]


def test_broker_address_is_the_bundled_service() -> None:
    config = find("ConfigMap", "rill")["data"]
    url = urlsplit(config["RILL_REDIS_URL"])
    service = find("Service", "rill-redis")
    namespace = kustomization()["namespace"]
    assert url.hostname == f"{service['metadata']['name']}.{namespace}.svc"
    assert url.port == service["spec"]["ports"][0]["port"]
    broker = find("StatefulSet", "rill-redis")
    assert service["spec"]["selector"] == broker["spec"]["template"]["metadata"]["labels"]
    args = broker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction", "full broker: 503, not lost entries"


def test_keda_scales_replicas_on_their_groups_lag() -> None:
    """KEDA's ScaledObject CRD is not in Kubernetes' schemas: checked here field by field. Each
    stage reads many streams (one per gateway / engine), so KEDA reads the lag the gateways export."""
    groups = {"tokenizer": TOKENIZER_GROUP, "detokenizer": DETOKENIZER_GROUP}
    series = exported_series()
    scaled = [d for d in manifests() if d["apiVersion"].startswith("keda.sh/")]
    assert {d["kind"] for d in scaled} == {"ScaledObject"} and {d["apiVersion"] for d in scaled} == {"keda.sh/v1alpha1"}
    targets = set()
    for so in scaled:
        assert set(so) == {"apiVersion", "kind", "metadata", "spec"}
        spec = so["spec"]
        assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval",
                             "cooldownPeriod", "triggers", "advanced", "fallback", "idleReplicaCount"}
        target = find("Deployment", spec["scaleTargetRef"]["name"])
        (container,) = target["spec"]["template"]["spec"]["containers"]
        ns = build_parser().parse_args(rendered_args(container))
        # At least one replica: the gateways' /health needs a live replica of each stage.
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        (trigger,) = spec["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "prometheus" and set(meta) <= KEDA_PROMETHEUS, meta
        assert all(isinstance(v, str) for v in meta.values()), "KEDA trigger metadata values are strings"
        # The series the gateways export, for this Deployment's own group.
        query = re.fullmatch(r'max\((rill:[a-z_:]+)\{group="([a-z]+)"\}\)', meta["query"])
        assert query is not None, meta["query"]
        assert query[1] == "rill:consumer_group_lag" and "group" in series[query[1]]
        assert query[2] == groups[ns.name]
        assert float(meta["threshold"]) > 0 and float(meta["activationThreshold"]) >= 0
        assert urlsplit(meta["serverAddress"]).scheme in ("http", "https")
        targets.add(ns.name)
    assert targets == set(groups)


def exported_series() -> dict[str, set[str]]:
    """Every sample name /metrics can export, with its label names: a gateway's registry after
    one request, with an engine (queue histogram included) and both replica groups' backlogs."""
    m = GatewayMetrics("m")
    req = m.request()
    req.accepted = True
    req.finish()
    stats = EngineStats(engine_id=0, queue_time_bounds=[0.1], queue_time_counts=[1, 2])
    text = m.render([stats], [GroupBacklog(TOKENIZER_GROUP, 1, 0), GroupBacklog(DETOKENIZER_GROUP, 2, 1)])
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def test_dashboard_and_scrape_config_use_real_metrics() -> None:
    series = exported_series()
    dashboard = json.loads((K8S / "grafana-dashboard.json").read_text())
    used: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            names = set(re.findall(r"rill:[a-zA-Z0-9_:]+", expr))
            assert names, expr
            unknown = names - set(series)
            assert not unknown, f"{panel['title']}: not exported by /metrics: {sorted(unknown)}"
            labels = set().union(*(series[n] for n in names))
            for group in re.findall(r"\bby \(([^)]*)\)", expr):
                assert {x.strip() for x in group.split(",")} <= labels, expr
            used |= names
    # What the dashboard is for: throughput, TTFT / ITL percentiles, KV usage, queue lengths,
    # preemptions, prefix-cache hit rate, replica lag.
    assert used >= {"rill:generation_tokens_total", "rill:time_to_first_token_seconds_bucket",
                    "rill:inter_token_latency_seconds_bucket", "rill:kv_cache_usage_perc",
                    "rill:num_requests_waiting", "rill:num_requests_running", "rill:num_preemptions_total",
                    "rill:prefix_cache_hits_total", "rill:prefix_cache_queries_total", "rill:consumer_group_lag"}

    (job,) = yaml.safe_load((K8S / "prometheus.yaml").read_text())["scrape_configs"]
    assert job["metrics_path"] in {r.path for r in gateway_metrics.routes()}
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == [kustomization()["namespace"]]
    pod = find("Deployment", "rill-gateway")["spec"]["template"]
    port_names = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
    label_values = {f"__meta_kubernetes_pod_label_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v
                    for k, v in pod["metadata"]["labels"].items()}
    keeps = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert keeps
    for rule in keeps:  # every keep rule lets the gateway pods (and their http port) through
        (source,) = rule["source_labels"]
        values = port_names if source == "__meta_kubernetes_pod_container_port_name" else {label_values[source]}
        assert any(re.fullmatch(rule["regex"], v) for v in values), rule


def test_manifest_commands_serve_a_chat(redis_url: str, smollm2_dir: str) -> None:
    """The pods' commands as local processes: one of each (engine 0), the broker URL and the API
    key in the environment as the ConfigMap and Secret put them there, fast CPU settings after."""
    prefix = f"rillk8s-{os.getpid()}-{time.time_ns() % 10**8}"
    port = free_port()
    key = secrets.token_urlsafe(12)
    commands = {c["name"]: [*rill_executable(), *rendered_args(c), *stack_flags(prefix, port), "--device", "cpu"]
                for _, c in rill_containers()}
    env = dict(os.environ, RILL_WORKER_THREADS="2", PYTHONUNBUFFERED="1", **find("ConfigMap", "rill")["data"])
    env.update({"RILL_REDIS_URL": redis_url, "RILL_API_KEY": key})
    stack = ServiceStack(redis_url, prefix, port, commands, env=env).start()
    try:
        for resp in asyncio.run(count_chats(stack.base_url, api_key=key, counts=(3, 4))):
            assert resp.choices[0].message.content.strip()
        try:
            urllib.request.urlopen(f"{stack.base_url}/v1/models", timeout=5)
            raise AssertionError("the gateway served /v1/models without the API key")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
        with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        lag = {s.labels["group"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "rill:consumer_group_lag"}
        assert lag == {TOKENIZER_GROUP: 0, DETOKENIZER_GROUP: 0}, lag  # both replica groups, caught up
        assert stack.alive()
    finally:
        stack.stop()
