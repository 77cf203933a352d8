"""Several replicas of the server on a Ray cluster, behind a prefix-affine router.

``python -m ktransformers.serve_cluster --replicas 2 --model_path DIR`` (docs/scale-out.md).
Ray is an optional extra (``pip install 'ktransformers[cluster]'``): only
:mod:`.deployments` and :mod:`.cli` import it; :mod:`.routing` (the policy) and
:mod:`.asgi_call` (driving the server's own app inside a replica) do not.
"""
