"""Entry point of a disco worker process that has our NCCL library: ``python -m mqa_byoc.tp.disco_worker``.

``disco.ProcessSession(n, entrypoint="mqa_byoc.tp.disco_worker")`` (what :func:`mqa_byoc.tp.process_session`
makes) starts each worker with this module: it loads the library named by ``$MQA_BYOC_DISCO_NCCL`` (set by
the controller's :func:`mqa_byoc.tp.load_disco_nccl`), then runs TVM's own worker loop
(``tvm.exec.disco_worker``) with the same arguments.
"""

from __future__ import annotations


def main() -> None:
    from .ccl import load_disco_nccl

    load_disco_nccl(build=False)
    from tvm.exec import disco_worker

    disco_worker.main()


if __name__ == "__main__":
    try:
        main()
    except (OSError, KeyboardInterrupt):
        pass
