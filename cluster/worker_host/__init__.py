"""Hosting one worker without Ray: what it is built from (`build`), the role-agnostic loop (`loop`),
and the two ways to run it: its own process over a pipe (`process`) or a thread fed by queues
(`thread`, which the Ray actor wraps)."""
