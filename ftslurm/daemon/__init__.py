"""The submit-side daemon: durable state (`store`), pure decisions (`policy`), and the
reconcile loop that observes the scheduler, decides, records intent and acts (`reconcile`)."""
