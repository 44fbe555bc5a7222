# MLflow tracking server with the Postgres driver and the S3 client it needs.
FROM python:3.11-slim
RUN pip install --no-cache-dir mlflow==3.17.2 psycopg2-binary==2.9.13 boto3==1.44.8
EXPOSE 5000
