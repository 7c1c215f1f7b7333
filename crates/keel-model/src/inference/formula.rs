//! Closed forms: the share of prompt tokens served from cache under affinity and under load balancing, and where affinity stops paying.
