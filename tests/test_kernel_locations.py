"""Every location the lab prints in a real Jupyter kernel names the cell as the user sees it: ``In [n]``.

A notebook runs through nbclient in a fresh ``python3`` kernel; each location the lab reports (profiled
kernels, host syncs, new signatures, memory owners, graph breaks, the traceback of a failing profiled
cell, the ambient-mode line) is compared with the ``execution_count`` Jupyter gave the cell. IPython 8
and 9 count differently while a cell runs, so this is the test that pins the installed IPython.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

CELLS = [
    "%load_ext torchneuron_lab",
    # 1
    "import torch\n"
    "x = torch.randn(64, 64, device='neuron')\n"
    "def f(t):\n"
    "    u = t + 1\n"
    "    torch._dynamo.graph_break()\n"
    "    return u * 2",
    # 2: profiled, with allocator history for the cell
    "%%neuron_profile -q --memory\n"
    "y = x @ x\n"
    "z = y.sum().item()\n"
    "big = torch.empty(1 << 18, device='neuron')\n"
    "c = torch.cumsum(x, 0)",
    # 3
    "p = _neuron_profile\n"
    "gb = %neuron_graph_breaks -q -o f(x)\n"
    "mem = %neuron_memory -q -o",
    # 4: ambient mode
    "%neuron_watch on",
    # 5
    "w1 = x * 3\nw1.sum().item()",
    # 6: a failing profiled cell
    "%%neuron_profile -q\nw2 = x - 1\nraise RuntimeError('fails in the cell')",
    # 7
    "%neuron_watch off\n"
    "import json\n"
    "print('LOCATIONS ' + json.dumps({\n"
    "    'sources': sorted({e.source for e in p.events if e.source}),\n"
    "    'syncs': [e.source for e in p.events if e.kind == 'sync'],\n"
    "    'new_sig': sorted({e.source for e in p.events if e.new_signature and e.source}),\n"
    "    'breaks': [b['location'] for b in gb.breaks],\n"
    "    'owners': [a['location'] for a in mem.top_allocations if a['bytes'] >= (1 << 20)],\n"
    "    'error': _neuron_profile.error,\n"
    "}))",
]


@pytest.mark.slow  # a kernel start takes 7-40 s on this 2-core machine
def test_locations_equal_the_in_labels(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    count = [c.execution_count for c in nb.cells]
    assert count == list(range(1, len(CELLS) + 1))

    def outputs(i: int, kind: str) -> list[dict]:
        return [o for o in nb.cells[i].outputs if o.output_type == kind]

    for i in range(len(CELLS)):
        if i != 6:
            assert not outputs(i, "error"), (i, outputs(i, "error"))
    text = "".join(o.text for o in outputs(7, "stream"))
    facts = json.loads(text.split("LOCATIONS ", 1)[1].splitlines()[0])

    prof = count[2]
    # every kernel the profiled cell ran is located in that cell, on the line that launched it
    assert facts["sources"] and all(s.startswith(f"cell [{prof}], line ") for s in facts["sources"]), facts
    assert f"cell [{prof}], line 2" in facts["sources"]  # y = x @ x
    assert facts["syncs"] == [f"cell [{prof}], line 3"]  # .item()
    assert f"cell [{prof}], line 5" in facts["new_sig"]  # cumsum: a new signature
    assert facts["breaks"] == [f"cell [{count[1]}], line 5"]  # graph_break() inside f, defined in cell 1
    assert facts["owners"] == [f"cell [{prof}], line 4"]  # the 1 MiB `big`
    assert facts["error"] == "RuntimeError: fails in the cell"

    # the failing profiled cell: an error output (the cell failed), the user's frames only
    err = outputs(6, "error")
    assert len(err) == 1 and err[0]["ename"] == "RuntimeError"
    tb = "\n".join(err[0]["traceback"])
    plain = re.sub(r"\x1b\[[0-9;]*m", "", tb)
    assert "torchneuron_lab" not in plain
    assert f"In[{count[6]}], line 3" in plain.replace(" ", "").replace("Cell", "") or \
        f"In[{count[6]}]" in plain.replace(" ", "")
    # the ambient line of cell 5 names that cell
    watch = "".join(o.text for o in outputs(5, "stream"))
    assert f"[neuron] cell [{count[5]}]: 2 kernels" in watch and "1 host syncs" in watch
    # the failing profiled cell's two events are counted by the watch too
    watch6 = "".join(o.text for o in outputs(6, "stream"))
    assert f"[neuron] cell [{count[6]}]: 1 kernels" in watch6 or f"[neuron] cell [{count[6]}]: 1 kernel" in watch6
