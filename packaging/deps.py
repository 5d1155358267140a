"""Print the dependencies pyproject.toml declares (and those of the named extras), one per
line, so the set-up can install them before building the package itself."""
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
deps = list(project.get("dependencies", []))
for extra in sys.argv[2:]:
    deps += project.get("optional-dependencies", {}).get(extra, [])
print("\n".join(deps))
