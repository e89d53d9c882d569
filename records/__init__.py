"""The project's run records: the raw results the docs quote, by what was measured
(records/README.md), and the one-off investigations that made some of them
(``records.investigations``). Not part of the product: nothing in pycomm or bench
imports it, and no distribution ships it."""
