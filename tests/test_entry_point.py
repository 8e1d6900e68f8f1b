"""`backend="graphopt"` works in a fresh interpreter without `import graphopt`."""

import subprocess
import sys

SCRIPT = """
import sys, torch
assert "graphopt" not in sys.modules
assert "graphopt" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
f = torch.compile(lambda x: torch.relu(x) * 2, backend="graphopt", options={"lowering": "eager"})
x = torch.randn(8)
torch.testing.assert_close(f(x), torch.relu(x) * 2)
import graphopt
assert graphopt.last_report().status == "compiled"
print("ok")
"""


def test_entry_point_discovery_in_subprocess():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
