"""Renders, installs, upgrades and uninstalls the Helm chart with Helm's own Go
SDK (the helm-python-sdk package).

    helm_chart.py render CHART NAMESPACE RELEASE [VALUES.yaml...]      manifests on stdout
    helm_chart.py dry-run KUBECONFIG CHART NAMESPACE RELEASE [VALUES.yaml...]
    helm_chart.py install KUBECONFIG CHART NAMESPACE RELEASE [VALUES.yaml...]
    helm_chart.py upgrade KUBECONFIG CHART NAMESPACE RELEASE [VALUES.yaml...]
    helm_chart.py uninstall KUBECONFIG NAMESPACE RELEASE
    helm_chart.py reject CHART VALUES.yaml                             fails unless the schema rejects

Several values files merge, later ones winning (as `helm -f a -f b`).
`render` is `helm template` (what Argo CD runs): offline, `lookup` answers
nothing and the capabilities are Helm's defaults. `dry-run` is
`helm install --dry-run=server`: `lookup` and the capabilities come from the
cluster. Both lint the chart, check the values against values.schema.json and
print every object as one YAML stream, Namespaces first (the order Helm
installs in). `install`, `upgrade` and `uninstall` are Helm's, for real.
"""

import copy
import sys

import helm_python as helm


def merged(base, over):
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def values_of(paths):
    if not paths:
        return None
    values = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            values = merged(values, helm.values_from_yaml(f.read()))
    return values


def lint_values(values):
    """Lint renders offline, where the chart refuses to generate secrets:
    lint with placeholder ones where the values leave them to be generated."""
    v = copy.deepcopy(values or {})
    token = v.setdefault("dataPlaneToken", {})
    if not token.get("existingSecret") and not token.get("value"):
        token["value"] = "lint-placeholder-token-0123456789"
    keys = v.setdefault("gateway", {}).setdefault("apiKeys", {})
    if not keys.get("existingSecret") and not keys.get("keys"):
        keys["keys"] = {"lint": "sk-lint-placeholder"}
    return v


def checked(chart_dir, values):
    lint = helm.lint(chart_dir, lint_values(values))
    # Severities: 1 info, 2 warning, 4 error.
    problems = [m for m in lint["messages"] if m["severity"] >= 2] + lint["errors"]
    if problems:
        sys.exit(f"helm lint: {problems}")


def print_manifests(manifests):
    docs = []
    for path in sorted(manifests):
        if path.endswith("NOTES.txt"):
            continue
        for doc in manifests[path].split("\n---"):
            text = doc.strip()
            if text and any(not line.startswith("#") for line in text.splitlines() if line.strip()):
                docs.append(text)
    docs.sort(key=lambda d: 0 if "\nkind: Namespace" in "\n" + d else 1)
    sys.stdout.write("\n---\n".join(docs) + "\n")


def render(chart_dir, namespace, release, *values_paths):
    values = values_of(values_paths)
    checked(chart_dir, values)
    with helm.Chart.load(chart_dir) as chart:
        chart.validate_schema(values)
        try:
            manifests = chart.render(values, name=release, namespace=namespace, is_install=True)
        except helm.HelmError as e:
            sys.exit(f"render failed: {e}")
    print_manifests(manifests)


def dry_run(kubeconfig, chart_dir, namespace, release, *values_paths):
    values = values_of(values_paths)
    checked(chart_dir, values)
    with helm.Chart.load(chart_dir) as chart:
        chart.validate_schema(values)
    with helm.Config(kubeconfig_path=kubeconfig, namespace=namespace) as config:
        r = config.install(chart_dir, release, values, namespace=namespace, dry_run="server")
    print_manifests({"manifest": r["manifest"]})


def install(kubeconfig, chart_dir, namespace, release, *values_paths):
    with helm.Config(kubeconfig_path=kubeconfig, namespace=namespace) as config:
        r = config.install(
            chart_dir, release, values_of(values_paths), namespace=namespace,
            create_namespace=True, timeout=120,
        )
    print(r["status"])


def upgrade(kubeconfig, chart_dir, namespace, release, *values_paths):
    with helm.Config(kubeconfig_path=kubeconfig, namespace=namespace) as config:
        r = config.upgrade(chart_dir, release, values_of(values_paths), namespace=namespace, timeout=120)
    print(r["status"])


def uninstall(kubeconfig, namespace, release):
    with helm.Config(kubeconfig_path=kubeconfig, namespace=namespace) as config:
        r = config.uninstall(release, timeout=120)
    print(r.get("info", ""))


def reject(chart_dir, values_path):
    with helm.Chart.load(chart_dir) as chart:
        try:
            chart.validate_schema(values_of([values_path]))
        except helm.HelmValuesError as e:
            print(e)
            return
    sys.exit(f"{values_path} passed values.schema.json but should not have")


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {
        "render": render,
        "dry-run": dry_run,
        "install": install,
        "upgrade": upgrade,
        "uninstall": uninstall,
        "reject": reject,
    }[command](*args)
