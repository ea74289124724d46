"""tandem compute kernels: model forward, attention backends, KV layout, sampling.

Deliberately empty of imports and without ``__version__``: our import name ``kernels``
collides with the Hugging Face ``kernels`` hub package, and transformers probes (and may
import) it while answering ``is_kernels_available()``. Keeping this module trivial keeps
that probe cheap and makes it answer False (our distribution is tandem-serve 0.1.0).
"""
