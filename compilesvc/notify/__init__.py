"""What a state change sets off outside the service: webhooks (build callbacks and service-wide
subscriptions), signed and delivered from the outbox.

May import lifecycle (campaign events), the ledger and :mod:`compilesvc.refusals`.
"""
