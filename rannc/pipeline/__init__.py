"""The runtime: `runtime` (the facade the module calls), `routes` (where each value goes),
`transport` (typed message keys, isend/recv), `stage` (one microbatch of one stage), `executor`
(walks the schedule's actions), `grads` (bucketed gradient reduction), `rows` (row layouts),
`batchnorm` (BatchNorm across microbatches and replicas)."""
