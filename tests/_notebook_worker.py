"""Executes one notebook in its own process (tests/test_notebooks.py): nbclient's kernel client leaves heartbeat
threads and zmq sockets behind in the process that ran it, and their teardown at a later garbage collection
crashed the pytest process that used to host them (a segmentation fault several tests after the notebooks).

    python tests/_notebook_worker.py IN.ipynb OUT.ipynb KERNEL_DIR CWD TIMEOUT_S

Runs IN top to bottom on the kernel "specjax-test" found in KERNEL_DIR, with CWD as its working directory, and
writes the executed notebook (outputs included, also after a failing cell) to OUT. Exit status 1 on a failing cell.
"""
import sys

import nbformat
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient


def main() -> int:
    src, dst, kernel_dir, cwd, timeout = sys.argv[1:6]
    nb = nbformat.read(src, as_version=4)
    km = KernelManager(kernel_name="specjax-test", kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernel_dir]))
    client = NotebookClient(nb, km=km, timeout=int(timeout), resources={"metadata": {"path": cwd}})
    try:
        client.execute()
    except Exception as e:             # the failing cell's traceback is in the notebook's outputs and here
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        nbformat.write(nb, dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
