"""Elastic roles (``serve --elastic``): the samples the router takes (:mod:`.samples`), the
policy that picks roles from them (:mod:`.policy`) and the one that adds and retires
workers (:mod:`.scaling`). Pure decisions, no I/O: the router's controller applies them.
"""

__all__ = ["policy", "samples", "scaling"]
