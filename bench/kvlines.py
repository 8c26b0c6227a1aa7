"""The `key=value` lines the bench programs print, read back by the report
scripts (bench/connect_report.py, bench/vqp_report.py)."""


def parse(line):
    """Every key=value token of `line`: numbers as floats, the rest as
    strings; tokens without '=' (a line's leading tag) are skipped."""
    out = {}
    for kv in line.split():
        if "=" not in kv:
            continue
        k, v = kv.split("=", 1)
        try:
            out[k] = float(v)
        except ValueError:
            out[k] = v
    return out


def last_line(path, prefix):
    """The last line of `path` that starts with `prefix`, parsed; None when
    the file or such a line is missing."""
    if not path.exists():
        return None
    lines = [l for l in path.read_text(errors="replace").splitlines() if l.startswith(prefix)]
    return parse(lines[-1]) if lines else None
