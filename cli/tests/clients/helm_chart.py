"""Renders the Helm chart with Helm's own Go SDK (the helm-python-sdk package).

    helm_chart.py render CHART NAMESPACE RELEASE [VALUES.yaml]   manifests on stdout
    helm_chart.py reject CHART VALUES.yaml                       fails unless the schema rejects

`render` lints the chart, checks the values against values.schema.json, and
prints every rendered object as one YAML stream, Namespaces first (the order
Helm installs in).
"""

import sys

import helm_python as helm


def values_of(path):
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return helm.values_from_yaml(f.read())


def render(chart_dir, namespace, release, values_path=None):
    values = values_of(values_path)
    lint = helm.lint(chart_dir, values)
    # Severities: 1 info, 2 warning, 4 error.
    problems = [m for m in lint["messages"] if m["severity"] >= 2] + lint["errors"]
    if problems:
        sys.exit(f"helm lint: {problems}")
    with helm.Chart.load(chart_dir) as chart:
        chart.validate_schema(values)
        manifests = chart.render(values, name=release, namespace=namespace, is_install=True)
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


def reject(chart_dir, values_path):
    with helm.Chart.load(chart_dir) as chart:
        try:
            chart.validate_schema(values_of(values_path))
        except helm.HelmValuesError as e:
            print(e)
            return
    sys.exit(f"{values_path} passed values.schema.json but should not have")


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"render": render, "reject": reject}[command](*args)
