"""rudra_zmq: parameter-server distributed deep learning on ZeroMQ (a re-creation of Rudra).

Importing the package loads the compiled kernels; it fails with a clear message if they are
not built. See ``build_info()`` for what was compiled and how.
"""
__version__ = "0.1.0"

from . import kernels  # noqa: E402  (fails loudly if the extension is missing)


def build_info():
    """Facts about the compiled kernel extension, as a dict. Does not block.

    Keys: module_file, openmp, num_threads, parallel_threshold, cython_version,
    numpy_build_version, numpy_version, compile_args, version.
    """
    import numpy

    from . import _kernels

    info = dict(_kernels.compile_info())
    info.update(
        version=__version__,
        module_file=_kernels.__file__,
        num_threads=_kernels.get_num_threads(),
        parallel_threshold=_kernels.get_parallel_threshold(),
        numpy_version=numpy.__version__,
    )
    return info


__all__ = ["build_info", "kernels", "__version__"]
