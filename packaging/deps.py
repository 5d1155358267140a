"""Print the dependencies pyproject.toml declares (and those of the named extras), one per
line, so the set-up can install them before building the package itself.

    python packaging/deps.py pyproject.toml [EXTRA ...]

Runs on Python 3.10, which has no `tomllib`: there, the few arrays of strings this needs are
read by `_arrays` below (enough for this project's pyproject.toml, not a TOML parser).
"""
import ast
import sys


def _arrays(text: str) -> dict[str, dict[str, list[str]]]:
    """{table: {key: [strings]}} for every `key = [ "…", … ]` (arrays of strings only)."""
    out: dict[str, dict[str, list[str]]] = {}
    table, i, n = "", 0, len(text)
    while i < n:
        line_end = text.find("\n", i)
        line_end = n if line_end < 0 else line_end
        line = text[i:line_end].strip()
        if line.startswith("[") and not line.startswith("[["):
            table = line.strip("[] ")
            i = line_end + 1
            continue
        key, eq, rest = line.partition("=")
        if eq and rest.strip().startswith("["):
            start = text.index("[", i + text[i:line_end].index("="))
            depth, j, quote, chars = 0, start, None, []
            while j < n:   # up to the matching bracket, skipping strings and comments
                c = text[j]
                if quote:
                    if c == "\\" and quote == '"':
                        chars.append(text[j:j + 2])
                        j += 2
                        continue
                    if c == quote:
                        quote = None
                elif c in "\"'":
                    quote = c
                elif c == "#":
                    j = text.find("\n", j)
                    j = n if j < 0 else j
                    continue
                elif c == "[":
                    depth += 1
                elif c == "]":
                    depth -= 1
                chars.append(c)
                j += 1
                if depth == 0:
                    break
            value = ast.literal_eval("".join(chars))
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                out.setdefault(table, {})[key.strip().strip('"')] = value
            line_end = text.find("\n", j)
            line_end = n if line_end < 0 else line_end
        i = line_end + 1
    return out


def dependencies(path: str, extras: list[str]) -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:   # Python 3.10
        arrays = _arrays(open(path, encoding="utf-8").read())
        deps = list(arrays.get("project", {}).get("dependencies", []))
        optional = arrays.get("project.optional-dependencies", {})
    else:
        with open(path, "rb") as f:
            project = tomllib.load(f)["project"]
        deps = list(project.get("dependencies", []))
        optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            sys.exit(f"deps.py: {path} has no extra {extra!r} (it has: {', '.join(optional)})")
        deps += optional[extra]
    return deps


if __name__ == "__main__":
    print("\n".join(dependencies(sys.argv[1], sys.argv[2:])))
