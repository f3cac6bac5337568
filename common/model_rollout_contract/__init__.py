"""The contract between the three programs (server, sidecar, operator).

Everything that crosses a process boundary is defined here once, and nowhere else:

* :mod:`.names` — the rule for model, version and tenant names;
* :mod:`.versions` — the one order of versions (PEP 440, SemVer, else the history's);
* :mod:`.manifest` — the signed per-version manifest and its digest;
* :mod:`.layout` — where versions live in the store and on the pod's volume;
* :mod:`.annotations` — pod annotations and labels, and the Downward API file format;
* :mod:`.states` — phases, rollout stages and sidecar states;
* :mod:`.report` — the sidecar's status report (file and pod annotation);
* :mod:`.control` — the control-socket messages between sidecar and server;
* :mod:`.defaults` — every default that more than one place needs;
* :mod:`.argv` — the server and sidecar command lines the operator writes into pods.

It depends on the standard library and one small pure-Python library, ``packaging``
(PEP 440, for :mod:`.versions`), and no program package is imported here.
"""
