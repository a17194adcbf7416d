"""compilesvc core: compile specs, artifact keys, the SQL ledger, the artifact store and dispatch.

The core imports neither the web layer (``web/``) nor worker code (``workers/``); both depend on it.
"""

from compilesvc.spec.compile_spec import CompileSpec
from compilesvc.spec.keys import KEY_SCHEMA, KeySet, compute_keys
from compilesvc.spec.parsing import SpecError, load_spec_file, parse_spec

__all__ = ["KEY_SCHEMA", "CompileSpec", "KeySet", "SpecError", "compute_keys", "load_spec_file", "parse_spec"]
__version__ = "0.1.0"
