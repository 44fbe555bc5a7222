"""TIDE's pages inside the Airflow UI."""
