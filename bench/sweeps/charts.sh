# Sweep "charts": runs nothing; redraws the PNG beside every throughput table in bench/results/ from the table's own
# numbers (bench/charts.py), e.g. for tables written before charts were drawn. Sourced by bench.sh.
$PYTHON bench/charts.py bench/results/*.md
