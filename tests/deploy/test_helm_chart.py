"""The Helm chart (deploy/helm/weightd), rendered offline with several value sets.

Helm itself renders it: helm-python-sdk binds Helm's Go SDK (libhelm_c, Helm
v4) through ctypes, so the templates are read by Helm's own engine with no
helm binary and no cluster. Every rendered object is validated against the
Kubernetes API's JSON schemas, strictly (an unknown field is an error), with
kubernetes-validate's bundled schemas for the oldest Kubernetes the chart
supports (Chart.yaml's kubeVersion) and the newest bundled. The ServiceMonitor,
a Prometheus Operator CRD that kubernetes-validate does not know, is validated
against tests/deploy/schemas/servicemonitor-monitoring-v1.json, written from
the operator's documented fields. Then each test asserts what the values were
meant to produce: mounts and their sources, probes and the port they name,
env from the Secret, the token projection, annotations, the configuration
file the daemon reads.

A missing package fails the run (pip install -r tests/requirements.txt).
"""
import copy
import json
import os

import pytest

try:
    import helm_python
    import jsonschema
    import kubernetes_validate
    import referencing
    import yaml
except ImportError as e:  # a missing dependency fails, it never skips
    pytest.fail(f"the chart tests need helm-python-sdk, kubernetes-validate and PyYAML "
                f"(pip install -r tests/requirements.txt): {e}", pytrace=False)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
CHART = os.path.join(REPO, "deploy", "helm", "weightd")
RELEASE, NAMESPACE = "wd", "gpu-infra"
FULL = "wd-weightd"
# The chart's kubeVersion is >=1.27; the newest schemas kubernetes-validate bundles.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())


# ---- rendering and validation ----------------------------------------------------


def render(values=None):
    """The chart rendered with values (over values.yaml): {(kind, name): object}."""
    chart = helm_python.Chart.load(CHART)
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objs = {}
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                key = (doc["kind"], doc["metadata"]["name"])
                assert key not in objs, f"{key} rendered twice"
                objs[key] = doc
    return objs


def render_error(values):
    """The message of a render that must fail."""
    with pytest.raises(helm_python.HelmError) as e:
        render(values)
    return str(e.value)


def servicemonitor_validator():
    with open(os.path.join(HERE, "schemas", "servicemonitor-monitoring-v1.json")) as f:
        schema = json.load(f)
    # ObjectMeta and LabelSelector: the Kubernetes API's own definitions, as kubernetes-validate bundles them.
    defs = kubernetes_validate.utils.schema_contents(
        f"kubernetes-json-schema/v{KUBE_VERSIONS[-1]}-local-strict/_definitions.json", KUBE_VERSIONS[-1])
    registry = referencing.Registry().with_resource(
        "https://kubernetes.io/api/_definitions.json", referencing.Resource.from_contents(defs))
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(obj):
    """Validates one object strictly; raises on the first violation."""
    if obj["apiVersion"] == "monitoring.coreos.com/v1":
        servicemonitor_validator().validate(obj)
        return
    for v in KUBE_VERSIONS:
        kubernetes_validate.validate(obj, v, strict=True)


def rendered_valid(values=None):
    objs = render(values)
    for obj in objs.values():
        validate(obj)
    return objs


def lint(values=None):
    """helm lint --strict: returns its error and warning messages."""
    report = helm_python.lint(CHART, values, strict=True, namespace=NAMESPACE)
    return [m for m in report["messages"] if m["severity"] >= 2] + list(report.get("errors") or [])


# ---- reading the rendered objects --------------------------------------------------


def daemonset(objs):
    return objs[("DaemonSet", FULL)]


def pod(objs):
    return daemonset(objs)["spec"]["template"]


def container(objs):
    (c,) = [c for c in pod(objs)["spec"]["containers"] if c["name"] == "weightd"]
    return c


def env(c):
    return {e["name"]: e for e in c.get("env", [])}


def mounts(c):
    return {m["name"]: m for m in c["volumeMounts"]}


def volumes(objs):
    return {v["name"]: v for v in pod(objs)["spec"]["volumes"]}


def config(objs):
    return json.loads(objs[("ConfigMap", FULL)]["data"]["weightd.json"])


def port_of(c, name):
    (p,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return p


# ---- the value sets -------------------------------------------------------------------

PVC_SECRET_MONITOR = {
    "modelRoots": [
        {"name": "local", "mountPath": "/models", "hostPath": "/data/models", "hostPathType": "Directory"},
        {"name": "shared", "mountPath": "/shared-models", "persistentVolumeClaim": "models-rox"},
    ],
    "cache": {"enabled": True, "mountPath": "/cache", "hostPath": "", "persistentVolumeClaim": "node-cache"},
    "objectStore": {"region": "eu-west-1", "credentialsSecret": {"name": "s3-keys"}},
    "metrics": {"serviceMonitor": {"enabled": True, "interval": "30s", "labels": {"release": "prom"}}},
    "securityContext": {"runAsUser": 10001},
    "socket": {"group": 2000, "mode": "0660"},
}

WEB_IDENTITY = {
    "objectStore": {"region": "us-east-2", "endpoint": "https://s3.example.test",
                    "webIdentity": {"enabled": True, "roleArn": "arn:aws:iam::123456789012:role/weightd",
                                    "audience": "sts.amazonaws.com", "expirationSeconds": 3600}},
    "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/weightd"}},
    "cache": {"enabled": False},
}

PRIVILEGED_HOSTNET = {
    "gpu": {"privileged": True, "runtimeClassName": ""},
    "hostNetwork": True,
    "rolloutOnConfigChange": True,
    "extraArgs": ["--log-level", "debug"],
    "config": {"backend": "cuda", "host_pin_budget": "64GiB", "job_threads": 8},
    "metrics": {"podAnnotations": False, "port": 9500},
    "peerService": {"enabled": False},
    "resources": {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "96Gi"}},
}


@pytest.mark.parametrize("values", [None, PVC_SECRET_MONITOR, WEB_IDENTITY, PRIVILEGED_HOSTNET],
                         ids=["defaults", "pvc-secret-monitor", "web-identity", "privileged-hostnet"])
def test_renders_valid_and_lints(values):
    objs = rendered_valid(values)
    assert ("DaemonSet", FULL) in objs and ("ConfigMap", FULL) in objs
    assert lint(values) == []


def test_defaults():
    objs = rendered_valid()
    ds, p, c = daemonset(objs), pod(objs), container(objs)
    # Pods selected by the labels they carry.
    sel = ds["spec"]["selector"]["matchLabels"]
    assert sel == {"app.kubernetes.io/name": "weightd", "app.kubernetes.io/instance": RELEASE}
    assert sel.items() <= p["metadata"]["labels"].items()
    # Every GPU visible, none claimed.
    assert p["spec"]["runtimeClassName"] == "nvidia"
    assert env(c)["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env(c)["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "compute,utility"
    for c_ in p["spec"]["containers"] + p["spec"].get("initContainers", []):
        res = c_.get("resources", {})
        assert not any("nvidia.com" in k for part in res.values() for k in part), res
    assert "privileged" not in c["securityContext"]
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # The daemon in the foreground, its config file, its endpoints on the pod IP.
    assert c["command"] == ["weightd", "--foreground"]
    assert c["args"][:2] == ["--config", "/etc/weightd/weightd.json"]
    assert "metrics_address=$(POD_IP):9477" in c["args"]
    assert env(c)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # Probes: liveness /healthz, readiness /readyz, on the port the daemon listens on.
    assert port_of(c, "metrics") == 9477
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    # Scrape annotations name the same port and the metrics path.
    ann = p["metadata"]["annotations"]
    assert ann == {"prometheus.io/scrape": "true", "prometheus.io/port": "9477", "prometheus.io/path": "/metrics"}
    # Mounts and their sources.
    m, v = mounts(c), volumes(objs)
    assert m["socket-dir"]["mountPath"] == "/run/weightd" and not m["socket-dir"].get("readOnly")
    assert v["socket-dir"]["hostPath"] == {"path": "/run/weightd", "type": "DirectoryOrCreate"}
    assert m["model-models"] == {"name": "model-models", "mountPath": "/models", "readOnly": True}
    assert v["model-models"]["hostPath"] == {"path": "/models", "type": "Directory"}
    assert m["cache"]["mountPath"] == "/var/cache/weightd" and not m["cache"].get("readOnly")
    assert v["cache"]["hostPath"] == {"path": "/var/cache/weightd", "type": "DirectoryOrCreate"}
    assert m["config"]["mountPath"] == "/etc/weightd" and "subPath" not in m["config"]  # SIGHUP sees edits
    assert v["config"]["configMap"]["name"] == FULL
    # The configuration file: the socket in the shared directory, the roots as mounted.
    cfg = config(objs)
    assert cfg == {"backend": "cuda", "log_level": "info", "socket": "/run/weightd/weightd.sock",
                   "socket_group": "", "socket_mode": "0660", "model_roots": ["/models", "/var/cache/weightd"]}
    # Root without capabilities, the socket's group; no init container.
    assert p["spec"]["securityContext"] == {"runAsUser": 0, "runAsGroup": 995}
    assert "initContainers" not in p["spec"]
    assert p["spec"]["automountServiceAccountToken"] is False
    # The headless peer Service selects the same pods; no ServiceMonitor unless asked.
    svc = objs[("Service", f"{FULL}-peers")]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == sel
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9477, "targetPort": "metrics", "protocol": "TCP"}]
    assert not any(k == "ServiceMonitor" for k, _ in objs)
    # No object-store variables without object-store values.
    assert not any(k.startswith("AWS_") for k in env(c))
    assert objs[("ServiceAccount", FULL)]["automountServiceAccountToken"] is False


def test_pvc_secret_servicemonitor_nonroot():
    objs = rendered_valid(PVC_SECRET_MONITOR)
    p, c = pod(objs), container(objs)
    m, v = mounts(c), volumes(objs)
    assert v["model-local"]["hostPath"] == {"path": "/data/models", "type": "Directory"}
    assert v["model-shared"] == {"name": "model-shared",
                                 "persistentVolumeClaim": {"claimName": "models-rox", "readOnly": True}}
    assert m["model-shared"]["mountPath"] == "/shared-models" and m["model-shared"]["readOnly"] is True
    assert v["cache"] == {"name": "cache", "persistentVolumeClaim": {"claimName": "node-cache", "readOnly": False}}
    assert config(objs)["model_roots"] == ["/models", "/shared-models", "/cache"]
    # Keys from the Secret; the session token optional.
    e = env(c)
    assert e["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "s3-keys", "key": "AWS_ACCESS_KEY_ID"}
    assert e["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "s3-keys",
                                                                        "key": "AWS_SECRET_ACCESS_KEY"}
    assert e["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "s3-keys", "key": "AWS_SESSION_TOKEN",
                                                                    "optional": True}
    assert e["AWS_REGION"]["value"] == "eu-west-1"
    assert "AWS_WEB_IDENTITY_TOKEN_FILE" not in e and "AWS_ROLE_ARN" not in e
    # Non-root: the init container gives the socket directory to the daemon's user and group.
    assert p["spec"]["securityContext"] == {"runAsUser": 10001, "runAsGroup": 2000, "runAsNonRoot": True}
    (init,) = p["spec"]["initContainers"]
    assert init["command"] == ["sh", "-c", "chown 10001:2000 /run/weightd && chmod 0750 /run/weightd"]
    assert init["securityContext"]["runAsUser"] == 0
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert [x["mountPath"] for x in init["volumeMounts"]] == ["/run/weightd"]
    # The ServiceMonitor selects the peer Service by its labels, through the port it names.
    sm = objs[("ServiceMonitor", FULL)]
    svc = objs[("Service", f"{FULL}-peers")]
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] in [x["name"] for x in svc["spec"]["ports"]]
    assert (ep["path"], ep["interval"], ep["scrapeTimeout"]) == ("/metrics", "30s", "5s")
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node",
            "action": "replace"} in ep["relabelings"]


def test_web_identity():
    objs = rendered_valid(WEB_IDENTITY)
    c, v = container(objs), volumes(objs)
    e = env(c)
    assert e["AWS_ROLE_ARN"]["value"] == "arn:aws:iam::123456789012:role/weightd"
    assert e["AWS_WEB_IDENTITY_TOKEN_FILE"]["value"] == "/var/run/secrets/weightd/token/token"
    assert e["AWS_REGION"]["value"] == "us-east-2"
    assert e["AWS_ENDPOINT_URL"]["value"] == "https://s3.example.test"
    assert "AWS_ACCESS_KEY_ID" not in e
    (src,) = v["web-identity-token"]["projected"]["sources"]
    assert src == {"serviceAccountToken": {"path": "token", "audience": "sts.amazonaws.com",
                                           "expirationSeconds": 3600}}
    tok = mounts(c)["web-identity-token"]
    assert os.path.join(tok["mountPath"], src["serviceAccountToken"]["path"]) == \
        e["AWS_WEB_IDENTITY_TOKEN_FILE"]["value"]
    assert tok["readOnly"] is True
    sa = objs[("ServiceAccount", FULL)]
    assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/weightd"}
    assert pod(objs)["spec"]["serviceAccountName"] == FULL
    # The cache off: neither mounted nor a root.
    assert "cache" not in v and config(objs)["model_roots"] == ["/models"]


def test_privileged_hostnetwork_config():
    objs = rendered_valid(PRIVILEGED_HOSTNET)
    p, c = pod(objs), container(objs)
    assert c["securityContext"]["privileged"] is True and "capabilities" not in c["securityContext"]
    assert "runtimeClassName" not in p["spec"]
    assert p["spec"]["hostNetwork"] is True and p["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert c["args"][-2:] == ["--log-level", "debug"]
    assert "metrics_address=$(POD_IP):9500" in c["args"] and port_of(c, "metrics") == 9500
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"memory": "96Gi"}}
    assert not any(k == "Service" for k, _ in objs)
    cfg = config(objs)
    assert cfg["host_pin_budget"] == "64GiB" and cfg["job_threads"] == 8
    ann = p["metadata"]["annotations"]
    assert "prometheus.io/scrape" not in ann
    # A changed configuration changes the checksum, so the pods roll.
    other = copy.deepcopy(PRIVILEGED_HOSTNET)
    other["config"]["job_threads"] = 6
    assert pod(render(other))["metadata"]["annotations"]["checksum/config"] != ann["checksum/config"]
    assert len(ann["checksum/config"]) == 64


def test_refused_values_name_what_is_wrong():
    both = {"objectStore": {"credentialsSecret": {"name": "k"},
                            "webIdentity": {"enabled": True, "roleArn": "arn:aws:iam::1:role/r"}}}
    assert "credentialsSecret.name and webIdentity.enabled are both set" in render_error(both)
    assert "needs objectStore.webIdentity.roleArn" in render_error({"objectStore": {"webIdentity": {"enabled": True}}})
    assert "config.socket is set by the chart" in render_error({"config": {"socket": "/tmp/x.sock"}})
    assert "config.model_roots is set by the chart" in render_error({"config": {"model_roots": ["/x"]}})
    bad_root = {"modelRoots": [{"name": "m", "mountPath": "/m", "hostPath": "/m", "persistentVolumeClaim": "c"}]}
    assert "modelRoots[0]: give hostPath or persistentVolumeClaim, not both" in render_error(bad_root)
    no_root = {"modelRoots": [], "cache": {"enabled": False}}
    assert "name at least one model root" in render_error(no_root)


def test_validation_catches_what_it_should():
    """The validators refuse a misspelt field and a wrong type: a chart bug would not pass unseen."""
    objs = render(PVC_SECRET_MONITOR)
    ds = copy.deepcopy(daemonset(objs))
    c = ds["spec"]["template"]["spec"]["containers"][0]
    c["readinesProbe"] = c.pop("readinessProbe")
    with pytest.raises(jsonschema.ValidationError, match="readinesProbe"):
        validate(ds)
    ds = copy.deepcopy(daemonset(objs))
    ds["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "9477"
    with pytest.raises(jsonschema.ValidationError):
        validate(ds)
    sm = copy.deepcopy(objs[("ServiceMonitor", FULL)])
    sm["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError, match="15 seconds"):
        validate(sm)
    sm = copy.deepcopy(objs[("ServiceMonitor", FULL)])
    sm["spec"]["endpoint"] = sm["spec"].pop("endpoints")
    with pytest.raises(jsonschema.ValidationError, match="endpoint"):
        validate(sm)
    sm = copy.deepcopy(objs[("ServiceMonitor", FULL)])
    del sm["spec"]["selector"]
    with pytest.raises(jsonschema.ValidationError, match="selector"):
        validate(sm)


def test_operations_doc_points_at_the_chart():
    """The DaemonSet lives in the chart only: docs/operations.md names it and carries no copy."""
    with open(os.path.join(REPO, "docs", "operations.md")) as f:
        text = f.read()
    assert "deploy/helm/weightd" in text
    assert "kind: DaemonSet" not in text
