"""The Helm chart, rendered and linted by the real Helm library (helm-python-sdk wraps Helm's Go
SDK), every object validated by kubernetes-validate against Kubernetes 1.33, and its RBAC compared
with the API calls the operator's code makes."""

import json
import pathlib
import subprocess

import helm_python as helm
import kubernetes_validate
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
            # prometheus-operator's kinds are not in Kubernetes' schemas; checked below.
            continue
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_default_values_render_a_hardened_operator_with_leader_election():
    objects, notes = render()
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"]
    deployment = find(objects, "Deployment")
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
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]


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
    binding = find(objects, "ClusterRoleBinding")
    assert binding["subjects"][0]["name"] == find(objects, "ServiceAccount")["metadata"]["name"]
