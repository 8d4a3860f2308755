"""The local stack the CLI runs on one machine: a Kafka broker assembled from Maven Central
(:mod:`.broker`, three of them in :mod:`.broker_cluster`), its topics (:mod:`.admin`), the services as
detached processes (:mod:`.services`) and the supervisor that restarts them (:mod:`.supervisor`)."""
