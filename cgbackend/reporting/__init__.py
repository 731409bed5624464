"""What cgbackend tells the user: the partition report as data (report.py), its renderers (text in
report.py, HTML in html.py, the JSON Schema in schema.py), hints, launch coverage, the launch
profile and structured-trace artifacts. Nothing here changes what runs."""
