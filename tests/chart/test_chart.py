"""The Helm chart, rendered and linted by the real Helm library (helm-python-sdk wraps Helm's Go
SDK), every object validated by kubernetes-validate against Kubernetes 1.33, and its RBAC compared
with the API calls the operator's code makes."""

import base64
import json
import pathlib
import subprocess

import helm_python as helm
import kubernetes_validate
from cloudcoil.models.prometheus_operator import v1 as monitoring_v1
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ferry"
KUBERNETES = "1.33.0"


def render(values=None):
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values, name="ferry", namespace="ferry-system", is_install=True)
    objects = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects, out


def find(objects, kind, suffix=""):
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert matches, f"no {kind} rendered"
    return matches[0]


def custom_values():
    return yaml.safe_load((ROOT / "tests" / "chart" / "custom-values.yaml").read_text())


def test_lint_finds_no_error():
    for values in (None, custom_values()):
        report = helm.lint(str(CHART), values, kube_version="v1.33.0")
        errors = [m for m in report["messages"] if m["severity"] >= 3] + report["errors"]
        assert not errors, errors
        warnings = [m for m in report["messages"] if m["severity"] == 2]
        assert not warnings, warnings


@pytest.mark.parametrize("values", [None, "custom"], ids=["default-values", "custom-values"])
def test_every_rendered_object_is_valid_kubernetes_1_33(values):
    objects, _ = render(custom_values() if values == "custom" else None)
    crds = [yaml.safe_load(c["data"]) for c in helm.Chart.load(str(CHART)).crds]
    for obj in objects + crds:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            # prometheus-operator's kinds are not in Kubernetes' schemas: validated by its own.
            validate_monitoring(obj)
            continue
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def validate_monitoring(obj):
    """Validates a prometheus-operator object against the models generated from its CRDs
    (PyPI cloudcoil.models.prometheus-operator, v0.80): types, patterns and enums; and no field
    the CRD lacks (the models ignore unknown fields, so a round trip that loses one is refused)."""
    model = getattr(monitoring_v1, obj["kind"])
    parsed = model.model_validate(obj)
    back = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert back == obj, f"{obj['kind']} {obj['metadata']['name']} has fields its CRD lacks:\n{back}\n!=\n{obj}"


def test_default_values_render_a_hardened_operator_with_leader_election():
    objects, notes = render()
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == [
        "ClusterRole", "ClusterRoleBinding", "ConfigMap", "ConfigMap", "ConfigMap", "Deployment", "Deployment",
        "Role", "RoleBinding", "Secret", "Service", "Service", "ServiceAccount",
    ]
    deployment = find(objects, "Deployment", "ferry")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "ghcr.io/ferry-dev/ferry-operator:0.1.0"
    assert "--leader-elect=true" in container["args"]
    assert "--sidecar-image=ghcr.io/ferry-dev/ferry-sidecar:0.1.0" in container["args"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert {p["name"] for p in container["ports"]} == {"metrics"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert find(objects, "Service", "-metrics")["spec"]["ports"][0]["port"] == 8080
    assert "kubectl get inferenceservices" in notes["ferry/templates/NOTES.txt"]


def test_the_holder_runs_from_the_sidecar_image_and_the_operator_finds_it_by_its_labels():
    objects, _ = render()
    holder = find(objects, "Deployment", "-holder")
    pod = holder["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/ferry-dev/ferry-sidecar:0.1.0"
    assert container["command"] == ["/usr/local/bin/ferry-holder"]
    assert "--max-held=1024" in container["args"] and "--keep-alive=5s" in container["args"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8080, "admin": 9090}
    assert pod["spec"]["automountServiceAccountToken"] is False, "the holder never calls the API"
    # The operator's --holder-selector selects exactly the holder's pods.
    operator = find(objects, "Deployment", "ferry")["spec"]["template"]["spec"]["containers"][0]
    selector = next(a for a in operator["args"] if a.startswith("--holder-selector="))
    wanted = dict(kv.split("=") for kv in selector.split("=", 1)[1].split(","))
    assert wanted.items() <= pod["metadata"]["labels"].items() and wanted["app.kubernetes.io/component"] == "holder"
    assert holder["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    assert find(objects, "Service", "-holder")["spec"]["selector"] == pod["metadata"]["labels"]
    # Both sides read the holder's token from the one Secret.
    secret = find(objects, "Secret", "-holder-token")
    assert len(base64.b64decode(secret["data"]["token"])) == 40
    for side in (container, operator):
        env = {e["name"]: e.get("valueFrom") for e in side["env"]}
        assert env["FERRY_HOLDER_TOKEN"] == {"secretKeyRef": {"name": secret["metadata"]["name"], "key": "token"}}
    # Disabled: no holder, and an empty selector (no service goes to zero).
    objects, _ = render({"holder": {"enabled": False}})
    assert not [o for o in objects if o["metadata"]["name"].endswith("-holder")]
    operator = find(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "--holder-selector=" in operator["args"]


def test_custom_values_reach_the_objects():
    objects, _ = render(custom_values())
    deployment = find(objects, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["spec"]["replicas"] == 3
    assert container["image"] == "registry.example/ferry-operator:1.2.3"
    assert "--leader-elect=false" in container["args"]
    assert "--listen=0.0.0.0:9443" in container["args"]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "ferry-operator"
    assert not [o for o in objects if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    monitor = find(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "honorLabels": True, "interval": "15s"}]


@pytest.mark.parametrize(
    "values, names",
    [
        ({"replicaCount": 0}, "replicaCount"),
        ({"image": {"repository": "x", "pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"metrics": {"port": 80}}, "port"),
        ({"replicas": 2}, "replicas"),
    ],
)
def test_values_that_break_the_schema_are_refused_with_a_clear_message(values, names):
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmValuesError) as refused:
        chart.validate_schema(values)
    assert names in str(refused.value), str(refused.value)


def test_the_chart_crd_is_the_generated_one():
    assert (CHART / "crds" / "inferenceservice.yaml").read_bytes() == (ROOT / "crds" / "inferenceservice.yaml").read_bytes()


def rules_of(role):
    granted = set()
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    granted.add((group, resource, verb))
    return granted


def test_rbac_grants_exactly_the_calls_the_operator_makes():
    needed = json.loads(
        subprocess.run(
            ["cargo", "run", "--quiet", "-p", "ferry-operator", "--", "rbac"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout
    )

    def expected(rules):
        return {(r["apiGroup"], r["resource"], v) for r in rules for v in r["verbs"]}

    objects, _ = render()
    assert rules_of(find(objects, "ClusterRole")) == expected(needed["clusterRules"])
    assert rules_of(find(objects, "Role")) == expected(needed["namespaceRules"])
    # Routed services' InferencePools only where the chart is told they are used.
    routed, _ = render({"routing": {"inferencePools": True}})
    assert needed["routingRules"]
    assert rules_of(find(routed, "ClusterRole")) == expected(needed["clusterRules"] + needed["routingRules"])
    # ...where the operator also watches them (list, watch); not without the grant.
    def watches(objects):
        args = find(objects, "Deployment", "ferry")["spec"]["template"]["spec"]["containers"][0]["args"]
        return next(a for a in args if a.startswith("--watch-inference-pools="))
    assert (watches(objects), watches(routed)) == ("--watch-inference-pools=false", "--watch-inference-pools=true")
    binding = find(objects, "ClusterRoleBinding")
    assert binding["subjects"][0]["name"] == find(objects, "ServiceAccount")["metadata"]["name"]


MONITORING = CHART / "monitoring"


def dashboards_of(objects):
    return {
        name: json.loads(text)
        for o in objects if o["kind"] == "ConfigMap"
        for name, text in o["data"].items()
    }


def test_default_values_ship_the_dashboards_for_grafanas_sidecar_and_no_monitoring_crd_objects():
    objects, _ = render()
    maps = [o for o in objects if o["kind"] == "ConfigMap"]
    assert all(m["metadata"]["labels"]["grafana_dashboard"] == "1" for m in maps)
    assert all(m["metadata"]["namespace"] == "ferry-system" for m in maps)
    files = {p.name: json.loads(p.read_text()) for p in MONITORING.glob("*.json")}
    assert sorted(files) == ["ferry-autoscaler.json", "ferry-service.json", "ferry-tenants.json"]
    assert dashboards_of(objects) == files
    assert not [o for o in objects if o["apiVersion"].startswith("monitoring.coreos.com/")]
    objects, _ = render({"monitoring": {"dashboards": {"enabled": False}}})
    assert not [o for o in objects if o["kind"] == "ConfigMap"]


def test_custom_values_add_the_alerts_the_pod_monitor_and_honour_the_operators_labels():
    objects, _ = render(custom_values())
    maps = [o for o in objects if o["kind"] == "ConfigMap"]
    assert {m["metadata"]["namespace"] for m in maps} == {"monitoring"}
    assert all(m["metadata"]["labels"]["grafana_dashboard"] == "ferry" for m in maps)
    assert all(m["metadata"]["annotations"] == {"grafana_folder": "Ferry"} for m in maps)
    rule = find(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    # The same groups as the plain rules file.
    assert rule["spec"] == yaml.safe_load((MONITORING / "ferry-alerts.yaml").read_text())
    assert len(rule["spec"]["groups"][0]["rules"]) >= 9
    monitor = find(objects, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "ferry-worker", "app.kubernetes.io/managed-by": "ferry-operator",
    }
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml", "chat"]}
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert (endpoint["port"], endpoint["interval"]) == ("metrics", "30s")
    assert endpoint["relabelings"] == [
        {"sourceLabels": ["__meta_kubernetes_pod_label_ferry_dev_inference_service"], "targetLabel": "inferenceservice"}
    ]
    assert find(objects, "ServiceMonitor")["spec"]["endpoints"][0]["honorLabels"] is True
    objects, _ = render({"monitoring": {"podMonitor": {"enabled": True}}})
    assert find(objects, "PodMonitor")["spec"]["namespaceSelector"] == {"any": True}


def test_a_monitoring_object_with_a_field_its_crd_lacks_is_refused():
    objects, _ = render(custom_values())
    monitor = find(objects, "PodMonitor")
    validate_monitoring(monitor)
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "30s"
    with pytest.raises(AssertionError, match="fields its CRD lacks"):
        validate_monitoring(monitor)
    rule = find(objects, "PrometheusRule")
    rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    with pytest.raises(Exception, match="for"):
        validate_monitoring(rule)


class Strict(yaml.SafeLoader):
    """PyYAML keeps the last of a key given twice; Go's YAML parsers and kubeconform refuse it."""


def _no_duplicate_keys(loader, node, deep=False):
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    assert len(keys) == len(set(keys)), f"a key given twice at line {node.start_mark.line + 1}: {keys}"
    return loader.construct_mapping(node, deep)


Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicate_keys)


ROUTING = {
    "routing": {
        "inferencePools": True,
        "endpointPicker": {"enabled": True, "pool": "chat", "namespace": "ml", "image": {"tag": "v0.3.0"}},
        "httpRoute": {"enabled": True, "gateway": {"name": "inference-gateway", "namespace": "gateways"}},
    }
}


def test_the_endpoint_picker_and_its_route_render_only_when_asked_for_and_are_valid():
    report = helm.lint(str(CHART), ROUTING, kube_version="v1.33.0")
    assert not [m for m in report["messages"] if m["severity"] >= 2] + report["errors"], report
    plain, _ = render()
    assert not [o for o in plain if o["metadata"]["name"].endswith("-epp") or o["kind"] == "HTTPRoute"]
    objects, out = render(ROUTING)
    for path, text in out.items():
        if path.endswith(".yaml"):
            list(yaml.load_all(text, Loader=Strict))  # no key twice in a mapping (strict parsers refuse it)
    picker = [o for o in objects if o["metadata"]["name"] == "chat-epp"]
    assert sorted(o["kind"] for o in picker) == [
        "ConfigMap", "Deployment", "Role", "RoleBinding", "Service", "ServiceAccount",
    ]
    for obj in picker:
        assert obj["metadata"]["namespace"] == "ml"
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    # Where the operator's InferencePool points by default (spec.routing.endpointPicker):
    # the Service <service>-epp, gRPC on 9002.
    service = find(picker, "Service")
    assert service["spec"]["ports"][0]["port"] == 9002
    args = find(picker, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--pool-name=chat" in args and "--pool-namespace=ml" in args
    assert {o["metadata"]["labels"]["app.kubernetes.io/component"] for o in picker} == {"endpoint-picker"}
    config = yaml.safe_load(find(picker, "ConfigMap")["data"]["config.yaml"])
    assert config["kind"] == "EndpointPickerConfig"
    producer = next(p for p in config["plugins"] if p["type"] == "approx-prefix-cache-producer")
    assert producer["parameters"]["blockSizeTokens"] == 16, "Ferry's default kvBlockSize"
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    referenced = {r["pluginRef"] for profile in config["schedulingProfiles"] for r in profile["plugins"]}
    referenced |= {r["pluginRef"] for r in config["requestHandler"]["parsers"]}
    referenced |= {s["pluginRef"] for s in config["dataLayer"]["sources"]}
    referenced |= {e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]}
    assert referenced <= declared, referenced - declared
    route = find(objects, "HTTPRoute")
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway", "namespace": "gateways"}]
    rule = route["spec"]["rules"][0]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "chat"}]
    assert rule["retry"]["codes"] == [503]


def test_a_picker_without_its_pool_or_image_tag_is_refused_naming_the_value():
    for values, name in [
        ({"routing": {"endpointPicker": {"enabled": True, "image": {"tag": "v1"}}}}, "routing.endpointPicker.pool"),
        ({"routing": {"endpointPicker": {"enabled": True, "pool": "chat"}}}, "routing.endpointPicker.image.tag"),
    ]:
        with pytest.raises(Exception, match=name.replace(".", r"\.")):
            render(values)
