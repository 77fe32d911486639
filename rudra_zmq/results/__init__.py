"""Results: run records, reports beside the paper's tables, comparisons, plots."""
