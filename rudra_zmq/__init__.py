"""rudra_zmq: parameter-server distributed deep learning on ZeroMQ (a re-creation of Rudra).

Importing the package loads the compiled kernels; it fails with a clear message if they are
not built. See ``build_info()`` for what was compiled and how.

The Python API (docs/api.md): ``train``, ``simulate``, ``load_config``, ``Config``,
``TrainResult``, ``TrainingError``, ``ConfigError``, ``UserCodeError``. They are imported from
``rudra_zmq.api`` on first use, so that the roles, which import this package too, do not pay
for the launcher and the plotting it needs.
"""

__version__ = "0.1.0"

from . import kernels  # noqa: E402  (fails loudly if the extension is missing)
from .kernels import build_info  # noqa: E402

_API = (
    "train",
    "simulate",
    "load_config",
    "Config",
    "TrainResult",
    "TrainingError",
    "ConfigError",
    "UserCodeError",
)


def __getattr__(name):
    # PEP 562: the API's names, imported when first used (see the module docstring)
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["build_info", "kernels", "__version__", *_API]
