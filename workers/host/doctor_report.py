"""``compilesvc doctor``'s report as a person reads it: the verdict, one line per check, the host's facts,
and for each failed check its class, code and the tail of its output."""

from __future__ import annotations

from typing import Any

from workers.host.versions import NEURON_SDK_ENV

#: A check's status.
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


def no_neuron_toolchain(facts: dict[str, Any]) -> bool:
    """Neither neuronx-cc nor torch-neuronx: a cpu host, or a Neuron host whose environment is not active."""
    return facts["neuronx_cc_path"] is None and facts["versions"]["torch-neuronx"] is None


def render_text(report: dict[str, Any]) -> str:
    checks = report["checks"]
    failed = [c for c in checks if c["status"] == FAIL]
    verdict = f"FAIL ({len(failed)} of {len(checks)} checks failed)" if failed else "PASS"
    lines = [f"compilesvc doctor: {verdict}", ""]
    if no_neuron_toolchain(report["host"]):
        torch = report["host"]["versions"].get("torch")
        lines += ["This host has no Neuron toolchain (neither neuronx-cc nor torch-neuronx), so it cannot compile "
                  "for Neuron.",
                  f"A worker here serves the cpu target{f' (torch {torch})' if torch else ''}. To compile for "
                  "Neuron, activate or install the Neuron SDK (docs/neuron-hosts.md) and run doctor again.", ""]
    width = max(len(c["name"]) for c in checks)
    lines += [f"{c['status']:<4}  {c['name']:<{width}}  {c['detail']}  [{c['seconds']:.1f} s]" for c in checks]
    host = report["host"]
    versions = ", ".join(f"{k} {v or 'not installed'}" for k, v in host["versions"].items())
    lines += ["", "host:",
              f"  instance type       {host['instance_type'] or 'unknown (no EC2 DMI product name)'}",
              f"  neuron devices      {', '.join(host['neuron_devices']) or 'none'}",
              f"  target              {host['target']} ({host['target_source']})",
              f"  python              {host['python']}",
              f"  platform            {host['platform']}",
              f"  configured release  {host['configured_release'] or f'none ({NEURON_SDK_ENV} is not set)'}",
              f"  neuronx-cc          {host['neuronx_cc_path'] or 'not on PATH'}",
              f"  versions            {versions}"]
    for check in failed:
        if not (check["error_class"] or check["output_tail"]):
            continue  # its line above says all there is (the toolchain, the release)
        lines += ["", f"FAIL {check['name']}: class {check['error_class'] or '-'}, code {check['code'] or '-'}"]
        if check["output_tail"]:
            lines.append(f"  last {len(check['output_tail'])} lines of its output:")
            lines += [f"    {line}" for line in check["output_tail"]]
    if report["work_dir"]:
        lines += ["", f"work dirs kept in {report['work_dir']}"]
    elif any(c["output_tail"] for c in failed):
        lines += ["", "the work dirs named above are gone: run again with --keep DIR to keep them"]
    return "\n".join(lines)
